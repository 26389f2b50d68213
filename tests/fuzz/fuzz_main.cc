// A deterministic driver for the fuzz targets of this folder, so they run in every
// ctest without libFuzzer: it replays the seed inputs, then mutations of them
// (byte flips, truncations, insertions, splices) from a fixed-seed generator. Each
// target must return normally for every input (an error is fine; a crash, a hang or
// a sanitizer report is the bug). With clang, the same targets build as libFuzzer
// binaries (-DMOE_FUZZ=ON).
//
//   <target>_fuzz [ITERATIONS] [CORPUS_DIR]
//
// With CORPUS_DIR (tests/fuzz/corpus/<target>/, what the libFuzzer campaigns of
// tests/fuzz/campaign.sh kept) every file in it is replayed too, before the mutations.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
std::vector<std::string> fuzz_seeds();  // from the target's file

namespace {

uint64_t next(uint64_t& s) {
  s += 0x9e3779b97f4a7c15ull;
  uint64_t z = s;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string mutate(const std::vector<std::string>& seeds, uint64_t& rng) {
  std::string s = seeds[next(rng) % seeds.size()];
  const int edits = 1 + static_cast<int>(next(rng) % 4);
  for (int e = 0; e < edits; ++e) {
    switch (next(rng) % 5) {
      case 0:  // flip a byte
        if (!s.empty()) s[next(rng) % s.size()] = static_cast<char>(next(rng));
        break;
      case 1:  // truncate
        if (!s.empty()) s.resize(next(rng) % s.size());
        break;
      case 2:  // insert bytes
        s.insert(s.empty() ? 0 : next(rng) % s.size(), std::string(1 + next(rng) % 8, static_cast<char>(next(rng))));
        break;
      case 3: {  // splice with another seed
        const std::string& o = seeds[next(rng) % seeds.size()];
        if (!o.empty()) s += o.substr(next(rng) % o.size());
        break;
      }
      case 4:  // set a 4-byte big-endian length-like field to an edge value
        if (s.size() >= 4) {
          static const uint32_t edge[] = {0, 1, 0x7fffffff, 0xffffffff, 16u << 20};
          const uint32_t v = edge[next(rng) % 5];
          const size_t at = next(rng) % (s.size() - 3);
          for (int i = 0; i < 4; ++i) s[at + i] = static_cast<char>(v >> (24 - 8 * i));
        }
        break;
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::atol(argv[1]) : 5000;
  const std::vector<std::string> seeds = fuzz_seeds();
  for (const auto& s : seeds) LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  size_t kept = 0;
  if (argc > 2 && std::filesystem::is_directory(argv[2])) {
    std::vector<std::filesystem::path> files;
    for (const auto& f : std::filesystem::directory_iterator(argv[2]))
      if (f.is_regular_file()) files.push_back(f.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
      ++kept;
    }
  }
  uint64_t rng = 12345;
  for (long i = 0; i < iterations; ++i) {
    const std::string s = mutate(seeds, rng);
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  std::printf("%zu seeds, %zu corpus inputs and %ld mutations: no crash\n", seeds.size(), kept, iterations);
  return 0;
}
