// Does arithmetic between memory reads slow them, and how it is placed? A scratch model of a
// decode attention step, without the attention: 30 layers of SmolLM2-shaped K/V caches (64
// sequences of 640 tokens, 128-token blocks of 384-byte rows in a random order, in huge
// pages), two threads taking sequences in turn. Each sequence's K is read with AMX tile loads
// as the score pass reads it, then its V as three per-head passes, and `work` units of
// multiply-adds (16 each, on registers) stand for the arithmetic, placed by --mode:
//   phases: score work per 16-token chunk of K, then all softmax work at once, then V work
//           per chunk of V (as the tile kernel ran before its softmax moved);
//   spread: the softmax work done with the chunks of K instead.
// Prints the median ms over 9 passes and the bytes read per second.
//
//   g++ -O2 -fopenmp -mavx512f -mamx-tile benchmarks/read_overlap.cpp -o /tmp/read_overlap
//   /tmp/read_overlap phases 100 50 150      # score, softmax and V units per 16-token chunk
//   /tmp/read_overlap spread 100 50 150
//   /tmp/read_overlap phases 0 0 0           # the reads alone
//
// Linux on a CPU with AMX only. Time nothing else while it runs: the machine has two cores.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr long kSeqs = 64, kBlocksPerSeq = 5, kRow = 384, kBlock = 128 * kRow, kLayers = 30;
constexpr long kBlocks = kSeqs * kBlocksPerSeq + 1, kChunks = kBlocksPerSeq * 8;   // 16-token chunks

// As kernels/csrc/amx.h's, which this standalone program cannot include (it needs ATen).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// `units` x 16 multiply-adds in 8 independent chains.
__attribute__((noinline)) float work(long units) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
  for (long u = 0; u < units; ++u)
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  __m512 s = a[0];
  for (int i = 1; i < 8; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 || (strcmp(argv[1], "phases") != 0 && strcmp(argv[1], "spread") != 0)) {
    fprintf(stderr, "usage: %s phases|spread SCORE SOFTMAX V (work units per 16-token chunk)\n", argv[0]);
    return 2;
  }
  const bool spread = strcmp(argv[1], "spread") == 0;
  const long score_units = atol(argv[2]), softmax_units = atol(argv[3]), v_units = atol(argv[4]);
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {   // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    fprintf(stderr, "no AMX tiles for this process\n");
    return 1;
  }
  const size_t layer = 2 * kBlocks * kBlock, total = layer * kLayers;
  char* mem = static_cast<char*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (mem == MAP_FAILED) {
    fprintf(stderr, "could not map %zu bytes for the caches\n", total);
    return 1;
  }
  madvise(mem, total, MADV_HUGEPAGE);
  memset(mem, 1, total);
  std::vector<int> order(kSeqs * kBlocksPerSeq);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i) + 1;
  std::shuffle(order.begin(), order.end(), std::mt19937(0));

  std::vector<double> times;
  float sink = 0.f;
  for (int pass = 0; pass < 9; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    for (long l = 0; l < kLayers; ++l) {
      const char* k = mem + l * layer;
      const char* v = k + kBlocks * kBlock;
      std::atomic<long> next{0};
#pragma omp parallel num_threads(2)
      {
        TileConfig config;
        for (int i = 0; i < 8; ++i) {
          config.bytes_per_row[i] = 64;
          config.rows[i] = 16;
        }
        _tile_loadconfig(&config);
        float local = 0.f;
        for (long s = next++; s < kSeqs; s = next++) {
          auto rows = [&](const char* cache, long c) {   // chunk c's 16 rows
            return cache + order[s * kBlocksPerSeq + c / 8] * kBlock + (c % 8) * 16 * kRow;
          };
          for (long c = 0; c < kChunks; ++c) {   // K: six 64-byte columns of 16 rows
            for (int col = 0; col < 6; col += 2) {
              _tile_loadd(2, rows(k, c) + 64 * col, kRow);
              _tile_loadd(3, rows(k, c) + 64 * col + 64, kRow);
            }
            local += work(score_units + (spread ? softmax_units : 0));
          }
          if (!spread) local += work(softmax_units * kChunks);
          for (int head = 0; head < 3; ++head)   // V: a pass per KV head, two columns each
            for (long c = 0; c < kChunks; ++c) {
              _tile_loadd(4, rows(v, c) + 128 * head, kRow);
              _tile_loadd(5, rows(v, c) + 128 * head + 64, kRow);
              local += work(v_units / 3);
            }
        }
        _tile_release();
#pragma omp atomic
        sink += local;
      }
    }
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  const double bytes = 2.0 * kSeqs * kBlocksPerSeq * kBlock * kLayers, median = times[times.size() / 2];
  printf("%s %ld %ld %ld: %.2f ms, %.1f GB/s (checksum %g)\n", argv[1], score_units, softmax_units, v_units,
         1e3 * median, bytes / median / 1e9, sink);
  return 0;
}
