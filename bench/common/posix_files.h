// Files and directories through POSIX calls for the benchmarks (PyTorch's pip LibTorch exports its
// own copies of the C++17 filesystem library; docs/building.md). Errors throw std::system_error naming the path.
#pragma once

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <system_error>
#include <vector>

namespace bench_files {

// The error of the failed call just made (errno), as "<what> <path>".
inline std::system_error system_error(const std::string& what, const std::string& path) {
  return std::system_error(errno, std::generic_category(), what + " " + path);
}

// The paths of the entries of `dir` except "." and "..".
inline std::vector<std::string> list_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) throw system_error("cannot open directory", dir);
  std::vector<std::string> paths;
  for (;;) {
    errno = 0;
    const dirent* e = ::readdir(d);
    if (e == nullptr) break;
    const std::string name = e->d_name;
    if (name != "." && name != "..") paths.push_back(dir + "/" + name);
  }
  const int error = errno;
  ::closedir(d);
  errno = error;
  if (error != 0) throw system_error("cannot read directory", dir);
  return paths;
}

// Creates `dir` and its missing parents (mkdir -p); ranks may race to make the same ones.
inline void make_dirs(const std::string& dir) {
  for (size_t end = 1; end <= dir.size(); ++end) {
    if ((end < dir.size() && dir[end] != '/') || dir[end - 1] == '/') continue;
    const std::string prefix = dir.substr(0, end);
    struct stat st {};
    if (::stat(prefix.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;
    if (::mkdir(prefix.c_str(), 0777) == 0) continue;
    if (errno == EEXIST && ::stat(prefix.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;  // made meanwhile
    if (errno == EEXIST) errno = ENOTDIR;
    throw system_error("cannot create directory", dir);
  }
}

// Removes `path` and everything under it, not following symlinks (rm -rf); a missing path is no error.
inline void remove_all(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    throw system_error("cannot stat", path);
  }
  if (S_ISDIR(st.st_mode)) {
    for (const auto& p : list_dir(path)) remove_all(p);
    if (::rmdir(path.c_str()) != 0) throw system_error("cannot remove", path);
  } else if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    throw system_error("cannot remove", path);
  }
}

}  // namespace bench_files
