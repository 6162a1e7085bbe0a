// specrt_generate ENGINE_DIR --ids 1,5,9 [--max-new-tokens N] [--method none|draft|ngram|suffix]
//                 [--gamma G] [--temperature T] [--top-p P] [--top-k K] [--min-p M] [--seed S] [--threads N]
// Generates after the given token ids with libspecrt and prints one JSON line:
//   {"token_ids": [...], "finish_reason": "length", "stats": {...}}   (generated ids only)
// Exit status: 0 ok, 2 bad arguments, 1 an engine or runtime error (the message on stderr).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "specrt.hpp"

namespace {

int usage(const char *why) {
  std::fprintf(stderr,
               "error: %s\nusage: specrt_generate ENGINE_DIR --ids 1,5,9 [--max-new-tokens N] "
               "[--method none|draft|ngram|suffix] [--gamma G] [--temperature T] [--top-p P] [--top-k K] [--min-p M] "
               "[--seed S] [--threads N]\n",
               why);
  return 2;
}

bool parse_ids(const std::string &text, std::vector<int64_t> &ids) {
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    char *end = nullptr;
    long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0') return false;
    ids.push_back(v);
  }
  return !ids.empty();
}

bool number(const char *text, double &out) {
  char *end = nullptr;
  out = std::strtod(text, &end);
  return *text && *end == '\0';
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 2 || argv[1][0] == '-') return usage("ENGINE_DIR is required");
  std::vector<int64_t> ids;
  specrt::Params params;
  specrt_open_options options;
  specrt_open_options_init(&options);
  for (int i = 2; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return usage((flag + " needs a value").c_str());
    const char *value = argv[i + 1];
    double x;
    if (flag == "--ids") {
      if (!parse_ids(value, ids)) return usage("--ids takes comma-separated integers, e.g. 1,5,9");
    } else if (flag == "--method") {
      params.method = value;
    } else if (!number(value, x)) {
      return usage((flag + " takes a number").c_str());
    } else if (flag == "--max-new-tokens") params.max_new_tokens = static_cast<int>(x);
    else if (flag == "--gamma") params.gamma = static_cast<int>(x);
    else if (flag == "--temperature") params.temperature = x;
    else if (flag == "--top-p") params.top_p = x;
    else if (flag == "--top-k") params.top_k = static_cast<int>(x);
    else if (flag == "--min-p") params.min_p = x;
    else if (flag == "--seed") params.seed = static_cast<uint64_t>(x);
    else if (flag == "--threads") options.intra_op_threads = static_cast<int>(x);
    else return usage(("unknown option " + flag).c_str());
  }
  if (ids.empty()) return usage("--ids is required");
  try {
    specrt::Engine engine(argv[1], &options);
    specrt::Result r = engine.generate(ids, params);
    std::printf("{\"token_ids\": [");
    for (size_t i = 0; i < r.token_ids.size(); ++i) std::printf("%s%lld", i ? ", " : "", static_cast<long long>(r.token_ids[i]));
    const specrt_stats &s = r.stats;
    std::printf("], \"finish_reason\": \"%s\", \"stats\": {\"new_tokens\": %lld, \"target_passes\": %lld, "
                "\"draft_passes\": %lld, \"rounds\": %lld, \"proposed\": %lld, \"accepted\": %lld, \"rejections\": %lld, "
                "\"acceptance_rate\": %.6g, \"alpha\": %.6g, \"tokens_per_pass\": %.6g, \"wall_seconds\": %.6g, "
                "\"engine_seconds\": %.6g}}\n",
                r.finish_reason.c_str(), (long long)s.new_tokens, (long long)s.target_passes, (long long)s.draft_passes,
                (long long)s.rounds, (long long)s.proposed, (long long)s.accepted, (long long)s.rejections,
                s.acceptance_rate, s.alpha, s.tokens_per_pass, s.wall_seconds, s.engine_seconds);
  } catch (const specrt::Error &e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.status == SPECRT_ERROR_ARGUMENT ? 2 : 1;
  }
  return 0;
}
