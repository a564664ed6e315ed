// choose_exchange (hpmoe/planning.hpp): --exchange auto for library users
// and the PyTorch module, on the simulator's choice.
#include "hpmoe/planning.hpp"
#include "hpmoe/routing.hpp"
#include "sim/sim.hpp"

namespace hpmoe {

ExchangeChoice choose_exchange(const LayerConfig& config, const std::string& machine, const std::string& routing,
                               bool backward) {
  const sim::MachineModel m = sim::load_machine(machine);
  sim::SimRequest s;
  s.config = config;
  s.routing = parse_routing_spec(routing, 1);
  s.backward = backward;
  s.policy = sim::default_policy(m);
  s.refuse_over_memory = false;
  const sim::SimReport chosen = sim::simulate_choosing_exchange(m, s);
  return {chosen.config.exchange, chosen.exchange_choice + " on machine model '" + m.name + "'"};
}

}  // namespace hpmoe
