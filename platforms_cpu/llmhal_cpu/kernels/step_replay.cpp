// Replays a recorded step for llmhal's CPU step graphs (step_graph.py): the native kernel calls a
// decode step made, in order, each through its struct form `int fn(const void* args)`, with the
// same argument structs (pointers to the same buffers), without returning to Python in between.

#include <cstdint>

extern "C" {

// Calls fns[i](args[i]) for i < n. Returns 0, or i + 1 for the first call that returned nonzero
// (the calls after it are not made).
int64_t llmhal_step_replay(const void* const* fns, const void* const* args, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const auto fn = reinterpret_cast<int (*)(const void*)>(fns[i]);
    if (fn(args[i]) != 0) return i + 1;
  }
  return 0;
}

}  // extern "C"
