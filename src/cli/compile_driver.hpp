#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/routing.hpp"
#include "compiler/taskflow.hpp"

namespace hpmoe {

struct CompileRequest {
  LayerConfig config;
  RoutingSpec routing;
  ExpertPlacement placement;  // where the experts live; empty: contiguous
  std::string machine = "cpu:1";
  taskflow::Policy policy = taskflow::Policy::critical_path;
  bool forward = true, backward = false;
  std::int64_t rank = 0;  // whose program the figures describe
  std::uint64_t seed = 1;
};

struct CompiledPass {
  taskflow::Pass pass;
  std::vector<taskflow::Program> programs;  // one per rank
  taskflow::ProgramStats stats;             // of the requested rank
  double generate_seconds = 0;              // generation + scheduling, all ranks
  double verify_seconds = 0;                // all ranks together
  taskflow::VerifyReport verification;
};

struct CompileReport {
  LayerConfig config;
  std::string routing, machine, policy;
  std::int64_t rank = 0;
  RoutingStats routing_stats;
  std::vector<CompiledPass> passes;
};

// Routes one step (the real router on seeded weights and inputs, or a
// synthetic/trace source), then compiles, schedules and verifies each pass.
CompileReport compile_layer(const CompileRequest&);
nlohmann::json to_json(const CompileReport&);
std::string format_report(const CompileReport&);

// A dump holds every rank's program of one pass.
nlohmann::json dump_programs(const std::vector<taskflow::Program>&);
std::vector<taskflow::Program> load_programs(const std::string& path);


}  // namespace hpmoe
