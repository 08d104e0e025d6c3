#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "checkpoint/hash.h"
#include "fsdp/check.h"

namespace fsdp::checkpoint::detail {

namespace fs = std::filesystem;

namespace {
std::string reason() { return std::strerror(errno); }
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
  std::error_code ec;
  fs::create_directories(dir, ec);
  FSDP_CHECK(!ec, "cannot create directory '", dir, "': ", ec.message());
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
  std::error_code ec;
  fs::remove_all(path, ec);
  FSDP_CHECK(!ec, "cannot remove '", path, "': ", ec.message());
}

bool path_exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(path, ec));
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
  const fs::path parent = fs::path(p).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

std::string join_path(const std::string& dir, const std::string& name) { return dir + "/" + name; }

std::string last_component(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

}  // namespace fsdp::checkpoint::detail
