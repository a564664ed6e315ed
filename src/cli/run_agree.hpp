#pragma once
// Over MPI, every process is started with its own command line. Options
// that shape what the ranks exchange (the layer, the routing, the passes,
// the steps, where tensors are loaded from and saved to) must be the same
// on every rank, or a rank waits for a launch, a collective or a file that
// another never makes. agree_on_request compares them before anything else
// runs and names the first that differs.
#include "cli/run.hpp"

namespace hpmoe {

// Collective over `tr`'s ranks (this process is rank `me`). Throws on every
// rank when one was started with another value of an option than rank 0.
void agree_on_request(Transport& tr, int me, const RunRequest& req);

}  // namespace hpmoe
