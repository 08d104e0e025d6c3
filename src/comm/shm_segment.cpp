#include "comm/shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>

namespace fsdp {

namespace {

constexpr uint64_t kMagic = 0x336d68737064736full;  // "fsdpshm3"
// Staging buffers: 1 MiB each up to 8 members, smaller beyond, so a segment stays at 16 MiB
// (containers often give /dev/shm 64 MiB) whatever the number of ranks per host.
constexpr int64_t kMaxSlotBytes = int64_t(1) << 20, kMinSlotBytes = int64_t(64) << 10;
constexpr int64_t kSegmentDataBytes = int64_t(16) << 20;

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be plain 32-bit integers");

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
int64_t controls_offset() { return round_up(sizeof(ShmHeader), 64); }
int64_t data_offset(int size) { return round_up(controls_offset() + int64_t(sizeof(MemberControl)) * size, 4096); }
int64_t segment_bytes(int size) { return data_offset(size) + int64_t(2) * size * slot_bytes(size); }

std::string errno_text(int err) { return std::strerror(err); }

std::string octal_mode(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%03o", static_cast<unsigned>(mode & 0777));
  return text;
}

}  // namespace

Digest segment_tag(const std::string& token, const std::string& name, uint64_t nonce) {
  return hmac_sha256(token, "fsdp shm segment\n" + name + "\n" + std::to_string(nonce));
}

int64_t slot_bytes(int size) {
  return std::max(kMinSlotBytes, std::min(kMaxSlotBytes, kSegmentDataBytes / (2 * size) / 4096 * 4096));
}

uint64_t pid_namespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds slice) {
  timespec ts{};
  ts.tv_sec = slice.count() / 1000;
  ts.tv_nsec = (slice.count() % 1000) * 1000000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

ShmSegment::~ShmSegment() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

std::string ShmSegment::create(const std::string& name, uint64_t nonce, int size, const Digest& tag) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return "shm_open(" + name + ") failed: " + errno_text(errno);
  const int64_t bytes = segment_bytes(size);
  // Reserve the pages now: a size-limited /dev/shm (containers often have 64 MiB) would otherwise
  // accept the size and raise SIGBUS at the first page touched beyond its limit.
  if (const int err = posix_fallocate(fd, 0, bytes); err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return "reserving " + std::to_string(bytes) + " bytes for " + name + " failed: " + errno_text(err) +
           " (is /dev/shm full or too small?)";
  }
  std::string error = map(fd, bytes, name);
  close(fd);
  if (!error.empty()) {
    shm_unlink(name.c_str());
    return error;
  }
  auto* h = new (base_) ShmHeader;
  h->nonce = nonce;
  h->size = size;
  h->slot_bytes = slot_bytes(size);
  std::memcpy(h->tag, tag.data(), tag.size());
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  for (int m = 0; m < size; ++m) {
    auto* c = new (control(m)) MemberControl;
    c->posted.store(0);
    c->waiters.store(0);
    c->state.store(kRunning);
    c->pid = 0;
    c->pid_namespace = 0;
    pthread_mutex_init(&c->alive, &attr);
  }
  pthread_mutexattr_destroy(&attr);
  h->magic.store(kMagic, std::memory_order_release);
  return "";
}

std::string ShmSegment::open(const std::string& name, uint64_t nonce, int size, const Digest& tag) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos)
    return "'" + name + "' is not a shared-memory segment name";
  const int fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0);
  if (fd < 0) return "shm_open(" + name + ") failed: " + errno_text(errno);
  struct stat st {};
  std::string error;
  if (fstat(fd, &st) != 0)
    error = "fstat of " + name + " failed: " + errno_text(errno);
  else if (st.st_uid != geteuid())
    error = name + " belongs to uid " + std::to_string(st.st_uid) + ", not to this user (uid " +
            std::to_string(geteuid()) + "): it is not this job's segment, refused";
  else if ((st.st_mode & 077) != 0)
    error = name + " may be opened by other users (mode " + octal_mode(st.st_mode) +
            "): not a segment libfsdp created, refused";
  if (error.empty()) error = map(fd, segment_bytes(size), name);
  close(fd);
  if (!error.empty()) return error;
  const auto* h = header();
  if (h->magic.load(std::memory_order_acquire) != kMagic || h->nonce != nonce || h->size != size ||
      h->slot_bytes != slot_bytes(size))
    return name + " is not the segment the group's first member created (another host or /dev/shm namespace)";
  Digest theirs;
  std::memcpy(theirs.data(), h->tag, theirs.size());
  if (!digests_equal(theirs, tag))
    return name + " does not carry this job's tag: it was not created by a rank holding this job's FSDP_JOB_TOKEN, "
                  "refused";
  return "";
}

MemberControl* ShmSegment::control(int m) const {
  return reinterpret_cast<MemberControl*>(static_cast<char*>(base_) + controls_offset()) + m;
}

uint8_t* ShmSegment::buffer(int m, uint32_t round) const {
  return static_cast<uint8_t*>(base_) + data_offset(header()->size) +
         (int64_t(m) * 2 + round % 2) * header()->slot_bytes;
}

std::string ShmSegment::map(int fd, int64_t bytes, const std::string& name) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return "fstat of " + name + " failed: " + errno_text(errno);
  if (st.st_size < bytes)
    return name + " has " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(bytes);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return "mmap of " + name + " failed: " + errno_text(errno);
  base_ = p;
  bytes_ = bytes;
  return "";
}

}  // namespace fsdp
