// Weight-gradient tiles as the runtime runs them, under the two ways of
// sharing them between workers: 64-column tiles handed out in turn (each
// worker's neighbour in the same rows is another core's tile), and strips of
// whole rows (kernels::kWeightTileCols: a worker walks along its own rows).
// dW[e] (hidden x n) = XT[:, rows of e] (hidden x K, strided as the runtime's
// transposed activations) x DHP_e (K x n, panel-blocked), for every expert,
// into gradients far beyond the caches. Prints microseconds per 64 x 64 tile
// (median of 5 passes, slowest worker) and the CPU model.
//
//   build/bench/wgrad_layout [EXPERTS=128] [K=16] [N=1536] [WORKERS=2]
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
double pass_seconds(std::int64_t experts, std::int64_t k, std::int64_t n, int workers, std::int64_t strip,
                    const std::vector<float>& xt, std::int64_t ldxt, const std::vector<float>& dhp, float* dw) {
  constexpr std::int64_t H = 2048;
  const std::int64_t panel = kernels::weight_padded_k<float>(k) * kernels::kTileCols, panels = (n + 63) / 64;
  std::vector<double> seconds(static_cast<std::size_t>(workers));
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      const auto t0 = std::chrono::steady_clock::now();
      std::int64_t turn = 0;
      for (std::int64_t e = 0; e < experts; ++e) {
        const auto view = kernels::panel_view<float>(dhp.data() + e * panel * panels, k);
        for (std::int64_t i = 0; i < H; i += 64)
          for (std::int64_t j = 0; j < n; j += strip, ++turn)
            if (turn % workers == w)
              kernels::gemm_tile<float>(xt.data() + i * ldxt + e * k, ldxt, view, j, dw + (e * H + i) * n + j, n, 64,
                                        std::min(strip, n - j), k, false);
      }
      seconds[static_cast<std::size_t>(w)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  for (auto& t : pool) t.join();
  return *std::max_element(seconds.begin(), seconds.end());
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t experts = argc > 1 ? std::atoll(argv[1]) : 128, k = argc > 2 ? std::atoll(argv[2]) : 16;
  const std::int64_t n = argc > 3 ? std::atoll(argv[3]) : 1536;
  const int workers = argc > 4 ? std::atoi(argv[4]) : 2;
  if (experts < 1 || k < 1 || n < 64 || n % 64 != 0 || workers < 1 || workers > 64) {
    std::fprintf(stderr, "wgrad_layout: EXPERTS >= 1, K >= 1, N a multiple of 64, 1 <= WORKERS <= 64\n");
    return 2;
  }
  kernels::init();
  constexpr std::int64_t H = 2048;
  const std::int64_t ldxt = experts * k + 16;  // every expert's rows side by side, as in XT
  std::vector<float> xt(static_cast<std::size_t>(H * ldxt), 0.25f);
  std::vector<float> dhp(static_cast<std::size_t>(experts * kernels::weight_padded_k<float>(k) * n), 0.5f);
  std::unique_ptr<float[]> dw(new float[static_cast<std::size_t>(experts * H * n)]());
  const double tiles = double(experts) * (H / 64) * (n / 64) / workers;
  std::printf("cpu %s; %lld experts, dW %lld x %lld each (%.0f MiB in all), K %lld, %d workers\n", hpmoe::cpu_model_name().c_str(),
              static_cast<long long>(experts), static_cast<long long>(H), static_cast<long long>(n),
              double(experts * H * n * 4) / (1 << 20), static_cast<long long>(k), workers);
  for (const auto& [label, strip] : {std::pair<const char*, std::int64_t>{"64-column tiles in turn", 64},
                                     std::pair<const char*, std::int64_t>{"strips of whole rows", std::min(n, kernels::kWeightTileCols)}}) {
    std::vector<double> s;
    for (int rep = 0; rep < 6; ++rep) s.push_back(pass_seconds(experts, k, n, workers, strip, xt, ldxt, dhp, dw.get()));
    s.erase(s.begin());  // the first pass also faults the gradients in
    std::sort(s.begin(), s.end());
    std::printf("  %-26s %6.2f us per tile\n", label, s[s.size() / 2] / tiles * 1e6);
  }
}
