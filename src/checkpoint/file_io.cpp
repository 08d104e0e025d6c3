#include "checkpoint/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "checkpoint/hash.h"
#include "fsdp/check.h"

namespace fsdp::checkpoint::detail {

namespace {
std::string reason() { return std::strerror(errno); }

// Removes `path` and, for a directory, everything under it (symlinks themselves, never their
// targets); a missing path is no error. 0, or the errno of the first failure.
int remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return errno == ENOENT ? 0 : errno;
  if (S_ISDIR(st.st_mode)) {
    std::vector<std::string> names;
    if (const int err = list_dir(path, &names)) return err;
    for (const auto& name : names)
      if (const int err = remove_tree(join_path(path, name))) return err;
    return ::rmdir(path.c_str()) == 0 || errno == ENOENT ? 0 : errno;
  }
  return ::unlink(path.c_str()) == 0 || errno == ENOENT ? 0 : errno;
}
}  // namespace

File File::create(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  FSDP_CHECK(fd >= 0, "cannot create '", path, "': ", reason(), "; check that the directory is writable");
  return File(fd, path);
}

File File::open_read(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FSDP_CHECK(fd >= 0, "cannot open '", path, "': ", reason());
  return File(fd, path);
}

File::File(File&& other) noexcept : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t File::size() const {
  struct stat st {};
  FSDP_CHECK(::fstat(fd_, &st) == 0, "cannot stat '", path_, "': ", reason());
  return static_cast<uint64_t>(st.st_size);
}

void File::write_all(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, std::min<size_t>(bytes, size_t(1) << 30));
    if (n < 0 && errno == EINTR) continue;
    FSDP_CHECK(n > 0, "cannot write '", path_, "': ", n < 0 ? reason() : std::string("no progress"),
               "; check free space and quotas");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void File::pread_all(void* data, size_t bytes, uint64_t offset) const {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, std::min<size_t>(bytes, size_t(1) << 30), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    FSDP_CHECK(n >= 0, "cannot read '", path_, "' at byte ", offset, ": ", reason());
    FSDP_CHECK(n > 0, "'", path_, "' is truncated: it ends before byte ", offset + bytes,
               "; the checkpoint is damaged, use another one");
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

void File::sync() { FSDP_CHECK(::fsync(fd_) == 0, "cannot fsync '", path_, "': ", reason()); }

void File::close() {
  if (fd_ < 0) return;
  const int fd = std::exchange(fd_, -1);
  FSDP_CHECK(::close(fd) == 0, "cannot close '", path_, "': ", reason());
}

void make_dirs(const std::string& dir) {
  FSDP_CHECK(!dir.empty(), "cannot create directory '", dir, "': ", std::strerror(EINVAL));
  // Each prefix that ends before a '/' (repeated slashes skipped), then the whole path.
  for (size_t end = 1; end <= dir.size(); ++end) {
    if ((end < dir.size() && dir[end] != '/') || dir[end - 1] == '/') continue;
    const std::string prefix = dir.substr(0, end);
    struct stat st {};
    if (::stat(prefix.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;
    if (::mkdir(prefix.c_str(), 0777) == 0) continue;
    int err = errno;  // EEXIST: another process made it meanwhile, or it is no directory
    if (err == EEXIST) err = ::stat(prefix.c_str(), &st) == 0 && S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
    FSDP_CHECK(err == 0, "cannot create directory '", dir, "': ", std::strerror(err));
  }
}

void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  FSDP_CHECK(fd >= 0, "cannot open directory '", dir, "': ", reason());
  const int rc = ::fsync(fd);
  const std::string why = rc == 0 ? "" : reason();
  ::close(fd);
  FSDP_CHECK(rc == 0, "cannot fsync directory '", dir, "': ", why);
}

void rename_path(const std::string& from, const std::string& to) {
  FSDP_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename '", from, "' to '", to, "': ", reason());
}

void remove_all(const std::string& path) {
  const int err = remove_tree(path);
  FSDP_CHECK(err == 0, "cannot remove '", path, "': ", std::strerror(err));
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

int list_dir(const std::string& dir, std::vector<std::string>* names) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return errno;
  int err = 0;
  for (;;) {
    errno = 0;
    const dirent* entry = ::readdir(d);
    if (entry == nullptr) {
      err = errno;
      break;
    }
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names->push_back(name);
  }
  ::closedir(d);
  return err;
}

std::string read_file(const std::string& path, uint64_t max_bytes) {
  File f = File::open_read(path);
  const uint64_t n = f.size();
  FSDP_CHECK(n <= max_bytes, "'", path, "' has ", n, " bytes, more than the ", max_bytes,
             " expected; it is not what its name says");
  std::string s(static_cast<size_t>(n), '\0');
  f.pread_all(s.data(), s.size(), 0);
  return s;
}

std::string temporary_name(const std::string& path, uint64_t random) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p + ".tmp-" + to_hex(random);
}

std::string parent_dir(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  p.resize(slash);
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p.empty() ? std::string("/") : p;
}

std::string join_path(const std::string& dir, const std::string& name) { return dir + "/" + name; }

std::string last_component(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

}  // namespace fsdp::checkpoint::detail
