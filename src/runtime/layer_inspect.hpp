#pragma once
// The tools' view of a layer's step (hpmoe calibrate, the benches, tests):
// the programs its engine compiled, proved and ran, task by task. Not part
// of the installed API: a program is the compiler's internal form.
#include <vector>

#include "compiler/taskflow.hpp"
#include "hpmoe/layer.hpp"

namespace hpmoe {

struct StepInspector {
  // The programs (one per rank) of `step`'s engine's last launch of `pass`:
  // this step's until the layer's next forward of the same schedule takes
  // that engine (a tool reads them right after the step).
  static const std::vector<taskflow::Program>& programs(const Layer::Step& step,
                                                        taskflow::Pass pass = taskflow::Pass::forward);
};

}  // namespace hpmoe
