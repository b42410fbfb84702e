// A watch on CPU allocations, for tests: which allocations of at least a given size a step makes, from any
// thread (the trainer's, autograd's, the engine's). It holds a step to "no allocation proportional to the
// model where a reusable buffer will do" without relying on the profiler, which sees only its own thread.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace bagua_lite {

// Starts recording the size of every CPU allocation of at least `min_bytes` (>= 0). The first start puts
// a forwarding wrapper in front of torch's CPU allocator for the rest of the process (a relaxed atomic
// load per allocation while no watch runs). `traces`: also keep each one's C++ backtrace (slow; to find
// where an allocation comes from).
void alloc_watch_start(int64_t min_bytes, bool traces = false);

// Pauses (true) or resumes (false) the running watch: allocations made while paused are not recorded
// (from any thread: a test pauses around work that is not what it holds, such as torch's optimizer step).
// Without a running watch it does nothing.
void alloc_watch_pause(bool paused);

// Stops recording and returns the sizes recorded since the start, in the order they were made, and their
// backtraces (empty without `traces`).
std::pair<std::vector<int64_t>, std::vector<std::string>> alloc_watch_stop();

}  // namespace bagua_lite
