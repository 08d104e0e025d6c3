#include "comm/stall_diagnosis.h"

#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/check.h"

namespace fsdp {

namespace {

// Positions share kSlots keys, each holding the first member to publish there; a member never
// waits more than one position ahead of another, so a key's older position is stale.
constexpr uint64_t kSlots = 16;
const char* const kVerdictKey = "diverged";
const char* const kSeenKey = "diverged/seen";
// How long the member that found a divergence waits for the others to read it before it fails.
constexpr std::chrono::milliseconds kSettle{2000};

std::string slot_key(uint64_t sequence) { return "stall/" + std::to_string(sequence % kSlots); }

std::vector<uint8_t> encode(int member, const Fingerprint& f) {
  std::vector<uint8_t> v(sizeof(int32_t) + sizeof(Fingerprint));
  const auto m = static_cast<int32_t>(member);
  std::memcpy(v.data(), &m, sizeof(m));
  std::memcpy(v.data() + sizeof(m), &f, sizeof(f));
  return v;
}

bool decode(const std::vector<uint8_t>& v, int* member, Fingerprint* f) {
  if (v.size() != sizeof(int32_t) + sizeof(Fingerprint)) return false;
  int32_t m = 0;
  std::memcpy(&m, v.data(), sizeof(m));
  std::memcpy(static_cast<void*>(f), v.data() + sizeof(m), sizeof(*f));
  f->label[sizeof(f->label) - 1] = 0;
  *member = m;
  return true;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

StallDiagnosis::StallDiagnosis(c10::intrusive_ptr<c10d::Store> store, std::string group, int member, int size,
                               std::chrono::milliseconds after)
    : store_(std::move(store)), group_(std::move(group)), member_(member), size_(size), after_(after) {}

StallDiagnosis::Wait::Wait(StallDiagnosis* diagnosis, const Fingerprint& mine, std::function<void()> abort)
    : diagnosis_(diagnosis) {
  if (!diagnosis_) return;
  std::lock_guard<std::mutex> lock(diagnosis_->mu_);
  diagnosis_->waiting_ = true;
  diagnosis_->mine_ = mine;
  diagnosis_->abort_ = std::move(abort);
  diagnosis_->since_ = std::chrono::steady_clock::now();
  ++diagnosis_->waits_;
  if (!diagnosis_->divergence_.empty()) diagnosis_->abort_();
}

StallDiagnosis::Wait::~Wait() {
  if (!diagnosis_) return;
  std::lock_guard<std::mutex> lock(diagnosis_->mu_);
  diagnosis_->waiting_ = false;
  diagnosis_->abort_ = nullptr;
}

void StallDiagnosis::poll() {
  if (store_lost_) return;
  Fingerprint mine;
  uint64_t wait = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!waiting_ || !divergence_.empty() || std::chrono::steady_clock::now() < since_ + after_) return;
    mine = mine_;
    wait = waits_;
  }
  try {
    std::string divergence;
    bool found_here = false;
    if (published_ != wait) {
      published_ = wait;
      found_here = publish(mine, &divergence);
    }
    if (!found_here) divergence = read_verdict();
    if (!divergence.empty()) settle(divergence, found_here);
  } catch (const std::exception&) {
    store_lost_ = true;
    abort_wait();  // if a divergence was found, its wait ends
  }
}

bool StallDiagnosis::publish(const Fingerprint& mine, std::string* divergence) {
  const std::string key = slot_key(mine.sequence);
  const std::vector<uint8_t> value = encode(member_, mine);
  std::vector<uint8_t> expected;  // absent
  for (int attempt = 0; attempt < 8; ++attempt) {
    const std::vector<uint8_t> current = store_->compareSet(key, expected, value);
    if (current == value) return false;              // the first to publish at this position
    if (!expected.empty() && current == expected) {  // the stale value went meanwhile: the key is absent
      expected.clear();
      continue;
    }
    int who = -1;
    Fingerprint theirs;
    if (!decode(current, &who, &theirs) || theirs.sequence < mine.sequence) {
      expected = current;  // an earlier position's: replace it
      continue;
    }
    if (theirs.sequence > mine.sequence || theirs == mine) return false;
    *divergence = out_of_step_message(group_, member_, mine, who, theirs);
    return true;
  }
  return false;
}

std::string StallDiagnosis::read_verdict() {
  if (!store_->check({kVerdictKey})) return "";
  const std::vector<uint8_t> v = store_->get(kVerdictKey);
  return {v.begin(), v.end()};
}

void StallDiagnosis::settle(const std::string& divergence, bool found_here) {
  std::string verdict = divergence;
  if (found_here) {  // the first finder's words are every member's
    const std::vector<uint8_t> v = store_->compareSet(kVerdictKey, {}, bytes_of(divergence));
    verdict.assign(v.begin(), v.end());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    divergence_ = verdict;
  }
  // No member fails before every member has read the verdict (or kSettle has passed): a member
  // that fails closes its connections, which would end its peers' waits with a plainer error, and
  // the member that hosts the store takes the store with it.
  store_->add(kSeenKey, 1);
  const auto deadline = std::chrono::steady_clock::now() + kSettle;
  while (std::chrono::steady_clock::now() < deadline && store_->add(kSeenKey, 0) < size_)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  abort_wait();
}

void StallDiagnosis::abort_wait() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!divergence_.empty() && waiting_ && abort_) abort_();
}

void StallDiagnosis::throw_if_diverged() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!divergence_.empty()) FSDP_FAIL(divergence_);
}

}  // namespace fsdp
