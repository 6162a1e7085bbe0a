// app ENGINE_DIR: greedy draft-model decoding of 16 tokens after the ids 1, 5, 9, streamed.
#include <cstdio>

#include <specrt.hpp>

int main(int argc, char **argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: app ENGINE_DIR\n");
    return 2;
  }
  try {
    specrt::Engine engine(argv[1]);
    specrt::Params params;
    params.max_new_tokens = 16;
    specrt::Result r = engine.generate({1, 5, 9}, params, [](int64_t id) {
      std::printf("%lld ", static_cast<long long>(id));
      return true;  // keep going
    });
    std::printf("\n%s, %.2f tokens per target pass\n", r.finish_reason.c_str(), r.stats.tokens_per_pass);
  } catch (const specrt::Error &e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
