// hpmoe run --exchange auto: the exchange scheme the run uses, chosen by the
// simulator on a machine model of this host (cpu-local unless --machine
// says otherwise) for the run's layer, ranks, tokens, placement and
// routing, forward (and backward where the run has one). Deterministic:
// over MPI every process makes the same choice from the same request.
#include "cli/run.hpp"

#include "hpmoe/error.hpp"
#include "sim/sim.hpp"

namespace hpmoe {

void choose_run_exchange(RunRequest& req, const std::string& machine) {
  const sim::MachineModel m = sim::load_machine(machine);
  sim::SimRequest s;
  s.config = req.config;
  s.routing = req.routing.changes_every_step() ? req.routing.at_step(req.config, 0) : req.routing;
  s.placement = req.placement;
  s.seed = req.seed;
  s.backward = req.backward;
  s.policy = req.policy;
  s.refuse_over_memory = false;  // the run checks its own memory
  try {
    const sim::SimReport chosen = sim::simulate_choosing_exchange(m, s);
    req.config.exchange = chosen.config.exchange;
    req.exchange_choice = chosen.exchange_choice + " on machine model '" + m.name + "'";
  } catch (const Error& e) {
    throw Error(std::string("--exchange auto: the simulator could not choose for this run (") + e.what() +
                "): give --exchange assignment or rank");
  }
}

}  // namespace hpmoe
