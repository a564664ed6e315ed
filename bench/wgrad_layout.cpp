// Weight-gradient tiles as the runtime runs them, under the two ways of
// sharing them between workers: 64-column tiles handed out in turn (each
// worker's neighbour in the same rows is another core's tile), and strips of
// whole rows (kernels::kWeightTileCols: a worker walks along its own rows).
// dW[e] (hidden x n) = XT[:, rows of e] (hidden x K, strided as the runtime's
// transposed activations) x DHP_e (K x n, panel-blocked), for every expert,
// into gradients far beyond the caches; strips also with the output stored
// by non-temporal stores (kernels::gemm_tile_streamed, what the runtime's
// weight gradients use). Prints microseconds per 64 x 64 tile and GFLOP/s
// (median of 5 passes, slowest worker) and the CPU model.
//
//   build/bench/wgrad_layout [EXPERTS=128] [K=16] [N=1536] [WORKERS=2] [fp32|bf16] [ROWS=64]
//
// ROWS: rows of a tile (kernels::weight_tile_rows).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/kernels.hpp"
#include "kernels/peak.hpp"

using namespace hpmoe;

namespace {

// Seconds of the slowest worker for one pass over every expert's tiles;
// `strip` columns go to one worker at a time, in turn.
template <class T>
double pass_seconds(std::int64_t experts, std::int64_t k, std::int64_t n, std::int64_t rows, int workers, std::int64_t strip,
                    bool streamed,
                    const std::vector<T>& xt, std::int64_t ldxt, const std::vector<T>& dhp, float* dw) {
  constexpr std::int64_t H = 2048;
  const std::int64_t panel = kernels::weight_padded_k<T>(k) * kernels::kTileCols, panels = (n + 63) / 64;
  std::vector<double> seconds(static_cast<std::size_t>(workers));
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      const auto t0 = std::chrono::steady_clock::now();
      std::int64_t turn = 0;
      for (std::int64_t e = 0; e < experts; ++e) {
        const auto view = kernels::panel_view<T>(dhp.data() + e * panel * panels, k);
        const std::int64_t kp = kernels::padded_k<T>(k);
        for (std::int64_t i = 0; i < H; i += rows)
          for (std::int64_t j = 0; j < n; j += strip, ++turn) {
            if (turn % workers != w) continue;
            const T* a = xt.data() + i * ldxt + e * kp;
            float* c = dw + (e * H + i) * n + j;
            const std::int64_t m = std::min(rows, H - i), w = std::min(strip, n - j);
            if (streamed) kernels::gemm_tile_streamed<T>(a, ldxt, view, j, c, n, m, w, kp);
            else kernels::gemm_tile<T>(a, ldxt, view, j, c, n, m, w, kp, false);
          }
      }
      seconds[static_cast<std::size_t>(w)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  for (auto& t : pool) t.join();
  return *std::max_element(seconds.begin(), seconds.end());
}

template <class T>
void run(std::int64_t experts, std::int64_t k, std::int64_t n, std::int64_t rows, int workers) {
  constexpr std::int64_t H = 2048;
  const std::int64_t kp = kernels::padded_k<T>(k);
  const std::int64_t ldxt = experts * kp + 16;  // every expert's rows side by side, as in XT
  std::vector<T> xt(static_cast<std::size_t>(H * ldxt), T(0.25f));
  std::vector<T> dhp(static_cast<std::size_t>(experts * kernels::weight_padded_k<T>(k) * n), T(0.5f));
  kernels::AlignedVector<float> dw(static_cast<std::size_t>(experts * H * n));  // 64-byte aligned, as the runtime's buffers
  const double tiles = double(experts) * (H / 64) * (n / 64) / workers;  // 64 x 64 tiles' worth
  std::printf("cpu %s; %lld experts, dW %lld x %lld each (%.0f MiB in all), K %lld, tiles of %lld rows, %d workers, %s\n", hpmoe::cpu_model_name().c_str(),
              static_cast<long long>(experts), static_cast<long long>(H), static_cast<long long>(n),
              double(experts * H * n * 4) / (1 << 20), static_cast<long long>(k), static_cast<long long>(rows), workers, sizeof(T) == 2 ? "bf16" : "fp32");
  struct Mode {
    const char* label;
    std::int64_t strip;
    bool streamed;
  };
  const std::int64_t whole = std::min(n, kernels::kWeightTileCols);
  for (const Mode& mode : {Mode{"64-column tiles in turn", 64, false}, Mode{"strips of whole rows", whole, false},
                           Mode{"strips, streamed stores", whole, true}}) {
    std::vector<double> s;
    for (int rep = 0; rep < 6; ++rep)
      s.push_back(pass_seconds<T>(experts, k, n, rows, workers, mode.strip, mode.streamed, xt, ldxt, dhp, dw.data()));
    s.erase(s.begin());  // the first pass also faults the gradients in
    std::sort(s.begin(), s.end());
    const double per_tile = s[s.size() / 2] / tiles;
    std::printf("  %-26s %6.2f us per tile, %6.1f GFLOP/s a worker\n", mode.label, per_tile * 1e6,
                2.0 * 64 * 64 * double(kp) / per_tile / 1e9);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t experts = argc > 1 ? std::atoll(argv[1]) : 128, k = argc > 2 ? std::atoll(argv[2]) : 16;
  const std::int64_t n = argc > 3 ? std::atoll(argv[3]) : 1536;
  const int workers = argc > 4 ? std::atoi(argv[4]) : 2;
  const std::string dtype = argc > 5 ? argv[5] : "fp32";
  const std::int64_t rows = argc > 6 ? std::atoll(argv[6]) : 64;
  if (experts < 1 || k < 1 || n < 64 || n % 64 != 0 || workers < 1 || workers > 64 || rows < 1 || rows > kernels::kMaxTileRows || (dtype != "fp32" && dtype != "bf16")) {
    std::fprintf(stderr, "wgrad_layout: EXPERTS >= 1, K >= 1, N a multiple of 64, 1 <= WORKERS <= 64, DTYPE fp32 or bf16, 1 <= ROWS <= 256\n");
    return 2;
  }
  kernels::init();
  if (dtype == "bf16") run<bf16>(experts, k, n, rows, workers);
  else run<float>(experts, k, n, rows, workers);
}
