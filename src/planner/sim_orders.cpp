// The replay's entries and orders (sim_orders.h).
#include "planner/sim_orders.h"

#include <algorithm>

namespace fsdp::planner {

SimOrders sim_orders(const SimInput& input) {
  const int units = static_cast<int>(input.units.size());
  const int segments = static_cast<int>(input.segments.size());
  SimOrders o;
  // The stretches that read a parameter of their unit enter it; a unit none of whose stretches
  // says so is entered by all of them.
  std::vector<char> reads(units, 0);
  for (const SimSegment& s : input.segments) reads[s.unit] = reads[s.unit] || s.reads_params;
  o.enters.assign(segments, 0);
  for (int i = 0; i < segments; ++i) o.enters[i] = input.segments[i].reads_params || !reads[input.segments[i].unit];
  o.first_segment.assign(units, -1);
  std::vector<int> last_segment(units, -1);
  for (int i = 0; i < segments; ++i) {
    if (!o.enters[i]) continue;
    const int u = input.segments[i].unit;
    if (o.first_segment[u] < 0) {
      o.first_segment[u] = i;
      o.forward_order.push_back(u);
    }
    last_segment[u] = i;
  }
  // A unit's gradient buffers come with the first gradient backward brings it, and its gradients
  // are all in after the last; where none arrives, with its stretches.
  o.grads_in_segment = o.first_segment;
  o.grads_alloc_segment = last_segment;
  for (int i = segments - 1; i >= 0; --i)
    if (o.enters[i] && input.segments[i].grads_arrive) o.grads_in_segment[input.segments[i].unit] = i;
  for (int i = 0; i < segments; ++i)
    if (o.enters[i] && input.segments[i].grads_arrive) o.grads_alloc_segment[input.segments[i].unit] = i;
  // Each FlatParameter's buffer comes with its own first gradient (GradientReducer::prepare_grad).
  o.flat_alloc_segment.resize(units);
  for (int u = 0; u < units; ++u) o.flat_alloc_segment[u].assign(input.units[u].flats.size(), -1);
  for (int i = 0; i < segments; ++i)
    if (o.enters[i] && input.segments[i].grads_arrive)
      for (const int k : input.segments[i].arriving_flats)
        if (k < static_cast<int>(o.flat_alloc_segment[input.segments[i].unit].size()))
          o.flat_alloc_segment[input.segments[i].unit][k] = i;
  for (int u = 0; u < units; ++u)
    if (last_segment[u] >= 0) o.backward_order.push_back(u);
  std::sort(o.backward_order.begin(), o.backward_order.end(),
            [&](int a, int b) { return last_segment[a] > last_segment[b]; });
  // A checkpointed unit's run of stretches (one call of its forward) that enters an inner unit is recomputed whole.
  o.recomputes.assign(segments, {});
  std::vector<int> by_depth(units);  // outer units first
  for (int u = 0; u < units; ++u) by_depth[u] = u;
  std::stable_sort(by_depth.begin(), by_depth.end(),
                   [&](int a, int b) { return input.units[a].ancestors.size() < input.units[b].ancestors.size(); });
  for (const int c : by_depth) {
    if (!input.units[c].checkpointed) continue;
    auto within = [&](int i) {
      const int u = input.segments[i].unit;
      const auto& a = input.units[u].ancestors;
      return u == c || std::find(a.begin(), a.end(), c) != a.end();
    };
    for (int i = 0; i < segments;) {
      int end = i;
      bool inner = false;
      for (; end < segments && within(end); ++end) inner = inner || (o.enters[end] && input.segments[end].unit != c);
      if (inner) o.recomputes[end - 1].push_back(i);
      i = std::max(end, i + 1);
    }
  }
  // Units backward reaches without reading them (no stretch's backward reads a parameter, none is
  // recomputed) are not prefetched for it, and not kept for it (Note [Units backward does not read]).
  o.unread_in_backward.assign(units, 0);
  std::vector<char> read(units, 0);
  for (int i = 0; i < segments; ++i) {
    if (o.enters[i] && input.segments[i].backward_reads) read[input.segments[i].unit] = 1;
    for (const int from : o.recomputes[i])
      for (int j = from; j <= i; ++j)
        if (o.enters[j]) read[input.segments[j].unit] = 1;
  }
  for (const int v : o.backward_order) o.unread_in_backward[v] = !read[v];
  if (input.keep_first_in_backward)
    for (const int v : o.backward_order)
      if (v != 0) {
        if (input.units[v].reshard_after_forward && !o.unread_in_backward[v]) o.first_in_backward = v;
        break;
      }
  return o;
}

}  // namespace fsdp::planner
