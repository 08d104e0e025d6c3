#include "runtime/tracer.h"

#include <algorithm>
#include <fstream>
#include <iomanip>

#include "fsdp/check.h"

namespace fsdp {

const char* to_string(TraceEvent::Kind kind) {
  switch (kind) {
    case TraceEvent::Kind::kUnshardIssued: return "unshard issued";
    case TraceEvent::Kind::kUnshard: return "all-gather";
    case TraceEvent::Kind::kCompute: return "compute";
    case TraceEvent::Kind::kWait: return "wait";
    case TraceEvent::Kind::kReshard: return "reshard";
    case TraceEvent::Kind::kReduceIssued: return "reduce issued";
    case TraceEvent::Kind::kReduce: return "reduce";
    case TraceEvent::Kind::kStep: return "optimizer step";
  }
  return "?";
}

void Tracer::enable(bool on) {
  if (on && !enabled_) {
    events_.clear();
    collectives_.clear();
    exposed_us_ = 0;
    max_unsharded_ = 0;
    compute_unit_ = -1;
    start_ = Clock::now();
  }
  enabled_ = on;
}

double Tracer::since_start_us(Clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t - start_).count();
}

void Tracer::instant(TraceEvent::Kind kind, int unit, std::string label) {
  if (!enabled_) return;
  events_.push_back({kind, unit, std::move(label), "compute", since_start_us(Clock::now()), 0});
}

void Tracer::collective(TraceEvent::Kind kind, int unit, std::string label, std::string track, WorkPtr work) {
  if (!enabled_ || !work) return;
  collectives_.push_back({{kind, unit, std::move(label), std::move(track), 0, 0}, std::move(work)});
}

void Tracer::wait(int unit, std::string label, Clock::time_point start, Clock::time_point end) {
  if (!enabled_) return;
  const double us = std::chrono::duration<double, std::micro>(end - start).count();
  exposed_us_ += us;
  events_.push_back({TraceEvent::Kind::kWait, unit, std::move(label), "compute", since_start_us(start), us});
}

void Tracer::step(int unit, Clock::time_point start, Clock::time_point end, std::string track) {
  if (!enabled_) return;
  const double us = std::chrono::duration<double, std::micro>(end - start).count();
  events_.push_back({TraceEvent::Kind::kStep, unit, "optimizer step", std::move(track), since_start_us(start), us});
}

void Tracer::enter_compute(int unit) {
  if (!enabled_ || unit == compute_unit_) return;
  leave_compute();
  compute_unit_ = unit;
  compute_start_ = Clock::now();
}

void Tracer::leave_compute() {
  if (!enabled_ || compute_unit_ < 0) return;
  const auto now = Clock::now();
  events_.push_back({TraceEvent::Kind::kCompute, compute_unit_, "compute", "compute", since_start_us(compute_start_),
                     std::chrono::duration<double, std::micro>(now - compute_start_).count()});
  compute_unit_ = -1;
}

void Tracer::note_unsharded_units(int count) { max_unsharded_ = std::max(max_unsharded_, count); }

IterationTrace Tracer::finish_iteration(int rank, const std::vector<std::string>& unit_names) {
  IterationTrace trace;
  if (!enabled_) return trace;
  leave_compute();
  const auto now = Clock::now();
  trace.rank = rank;
  trace.iteration = iteration_++;
  trace.unit_names = unit_names;
  trace.duration_us = since_start_us(now);
  trace.exposed_comm_us = exposed_us_;
  trace.max_unsharded_units = max_unsharded_;
  trace.events = std::move(events_);
  for (auto& c : collectives_) {
    if (!c.work->completed()) continue;  // cannot happen at the end of backward; skip rather than block
    const WorkTiming t = c.work->timing();
    if (t.end.time_since_epoch().count() == 0) continue;
    c.event.start_us = since_start_us(t.start);
    c.event.duration_us = std::chrono::duration<double, std::micro>(t.end - t.start).count();
    trace.comm_us += c.event.duration_us;
    trace.events.push_back(std::move(c.event));
  }
  events_.clear();
  collectives_.clear();
  exposed_us_ = 0;
  max_unsharded_ = 0;
  start_ = now;
  return trace;
}

namespace {

void write_json_string(std::ostream& out, const std::string& s) {
  out << '"';
  for (char c : s) {
    switch (c) {
      case '"': out << "\\\""; break;
      case '\\': out << "\\\\"; break;
      case '\n': out << "\\n"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          out << "\\u" << std::hex << std::setw(4) << std::setfill('0') << int(c) << std::dec << std::setfill(' ');
        else
          out << c;
    }
  }
  out << '"';
}

}  // namespace

void IterationTrace::write_chrome_json(std::ostream& out) const {
  // Thread ids: 0 = compute, then one per communicator track in order of appearance.
  std::vector<std::string> tracks{"compute"};
  auto tid_of = [&](const std::string& track) {
    auto it = std::find(tracks.begin(), tracks.end(), track);
    if (it != tracks.end()) return static_cast<int>(it - tracks.begin());
    tracks.push_back(track);
    return static_cast<int>(tracks.size() - 1);
  };
  out << std::fixed << std::setprecision(3);
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  for (const auto& e : events) {
    const int tid = tid_of(e.track);
    const std::string unit = e.unit < 0 ? "" : (unit_names.at(e.unit).empty() ? "<root>" : unit_names.at(e.unit));
    std::string name = e.kind == TraceEvent::Kind::kWait ? "wait " + e.label : std::string(to_string(e.kind));
    if (!unit.empty()) name += " " + unit;
    out << (first ? "" : ",\n") << "{\"name\":";
    write_json_string(out, name);
    out << ",\"cat\":";
    write_json_string(out, to_string(e.kind));
    out << ",\"pid\":" << rank << ",\"tid\":" << tid << ",\"ts\":" << e.start_us;
    if (e.duration_us > 0 || e.kind == TraceEvent::Kind::kCompute || e.kind == TraceEvent::Kind::kWait ||
        e.kind == TraceEvent::Kind::kUnshard || e.kind == TraceEvent::Kind::kReduce ||
        e.kind == TraceEvent::Kind::kStep)
      out << ",\"ph\":\"X\",\"dur\":" << e.duration_us;
    else
      out << ",\"ph\":\"i\",\"s\":\"t\"";
    out << ",\"args\":{\"unit\":";
    write_json_string(out, unit);
    out << ",\"label\":";
    write_json_string(out, e.label);
    out << "}}";
    first = false;
  }
  for (size_t t = 0; t < tracks.size(); ++t) {
    out << (first ? "" : ",\n") << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << rank << ",\"tid\":" << t
        << ",\"args\":{\"name\":";
    write_json_string(out, tracks[t]);
    out << "}}";
    first = false;
  }
  out << (first ? "" : ",\n") << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank
      << ",\"args\":{\"name\":\"rank " << rank << "\"}}";
  out << "\n],\"otherData\":{\"iteration\":" << iteration << ",\"duration_us\":" << duration_us
      << ",\"comm_us\":" << comm_us << ",\"exposed_comm_us\":" << exposed_comm_us
      << ",\"max_unsharded_units\":" << max_unsharded_units << "}}\n";
}

void IterationTrace::write_chrome_json(const std::string& path) const {
  std::ofstream out(path);
  FSDP_CHECK(out, "cannot open trace file '", path, "' for writing");
  write_chrome_json(out);
  FSDP_CHECK(out.good(), "writing trace file '", path, "' failed");
}

}  // namespace fsdp
