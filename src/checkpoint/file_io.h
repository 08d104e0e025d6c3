#pragma once
// Files and directories for checkpoints: whole writes and positioned reads that retry short
// transfers, fsync of files and directories, and errors that name the path and the system's reason.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

class File {
 public:
  // A new file (fails if it exists), for writing from the start.
  static File create(const std::string& path);
  static File open_read(const std::string& path);
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  const std::string& path() const { return path_; }
  uint64_t size() const;
  void write_all(const void* data, size_t bytes);
  // Reads exactly `bytes` at `offset`; an end of file before that is an error ("truncated").
  void pread_all(void* data, size_t bytes, uint64_t offset) const;
  void sync();   // fsync
  void close();  // reports a failed close (a deferred write error)

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

// Creates `dir` and its missing parents; an existing directory is no error.
void make_dirs(const std::string& dir);
void sync_dir(const std::string& dir);
void rename_path(const std::string& from, const std::string& to);
// Removes a file or a directory tree (symlinks are removed, not followed); a missing path is no error.
void remove_all(const std::string& path);
// Whether something, a dangling symlink included, is at `path`.
bool path_exists(const std::string& path);
// Appends the names in `dir` except "." and ".." (any order); 0, or the errno that stopped the listing.
int list_dir(const std::string& dir, std::vector<std::string>* names);
// The whole file, refused beyond max_bytes.
std::string read_file(const std::string& path, uint64_t max_bytes);
// "<path>.tmp-<16 hex digits>" with the given random value.
std::string temporary_name(const std::string& path, uint64_t random);
// `dir` + "/" + `name`.
std::string join_path(const std::string& dir, const std::string& name);
// The last component of a path (trailing slashes ignored).
std::string last_component(const std::string& path);
// The parent directory of a path ("." for a bare name).
std::string parent_dir(const std::string& path);

}  // namespace fsdp::checkpoint::detail
