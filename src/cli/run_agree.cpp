#include "cli/run_agree.hpp"

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/fnv.hpp"
#include "hpmoe/error.hpp"

namespace hpmoe {

namespace {

// Each option that must agree, by the name the user typed, with its value as
// text (hashed before it travels).
std::vector<std::pair<std::string, std::string>> agreed_options(const RunRequest& req) {
  const RoutingSpec& r = req.routing;
  return {
      {"layer (preset, --config, --set, --dtype, -T)", to_json(req.config).dump()},
      {"--seed", std::to_string(req.seed)},  // before --routing, whose draws it seeds
      {"--routing", r.describe() + "|" + r.trace_path + "|" + r.trace_layer + "|" + std::to_string(r.seed)},
      {"--placement", req.placement.empty() ? std::string("contiguous") : to_json(req.placement).dump()},
      {"--backward", req.backward ? "on" : "off"},
      {"--workers (-W)", std::to_string(req.workers_per_rank)},
      {"--iters", std::to_string(req.iterations)},
      {"--warmup", std::to_string(req.warmup)},
      {"--verify", std::to_string(static_cast<int>(req.verify)) + "/" + std::to_string(req.sample_tokens)},
      {"--load", req.load_dir},
      {"--save", req.save_dir},
      {"--run", std::to_string(static_cast<int>(req.mode))},
      {"--schedule", std::to_string(static_cast<int>(req.policy))},
      {"--watchdog", std::to_string(req.watchdog_seconds)},
      {"--check-inprocess", req.check_inprocess ? "on" : "off"},
      {"--verify-all-ranks", req.verify_all_ranks ? "on" : "off"},
      {"--check-every", std::to_string(req.check_every)},
  };
}

}  // namespace

void agree_on_request(Transport& tr, int me, const RunRequest& req) {
  const auto options = agreed_options(req);
  const std::size_t n = options.size(), P = static_cast<std::size_t>(tr.ranks());
  std::vector<std::uint64_t> all(n * P, 0);
  for (std::size_t i = 0; i < n; ++i) all[static_cast<std::size_t>(me) * n + i] = fnv1a(options[i].second);
  tr.allgather(std::as_writable_bytes(std::span<std::uint64_t>(all)), n * sizeof(std::uint64_t));
  for (std::size_t q = 1; q < P; ++q)
    for (std::size_t i = 0; i < n; ++i)
      if (all[q * n + i] != all[i])
        throw Error("rank " + std::to_string(q) + " was started with another " + options[i].first + " than rank 0" +
                    (me == 0 || static_cast<std::size_t>(me) == q ? "" : " (this is rank " + std::to_string(me) + ")") +
                    ": start every rank with the same options");
}

}  // namespace hpmoe
