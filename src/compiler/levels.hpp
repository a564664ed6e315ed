// The levels of the per-rank proof (docs/proofs.md): the events other
// ranks' puts feed have levels. The dispatch of rows to experts (forward
// recv tiles, backward dy tiles) is level 0, the return of expert outputs
// to their sources (comb_done, dx_ready) level 1, the per-rank and per-node
// exchanges' later hops above. A put into a peer's level-l event may
// depend only on local events and on remote-fed events of levels below l,
// and nothing queued before it may wait on more: the verifier checks it,
// the scheduler keeps it. Each put kind's level is part of its role in the
// op table (ops/kind_role.hpp).
#pragma once

#include <cstdint>

#include "ops/access.hpp"

namespace hpmoe::taskflow {

// The level of the event a put signals at its peer.
inline std::int8_t put_level(TaskKind put) { return role(put).level; }
// The kind of task that waits on the event a put signals at its peer.
inline TaskKind remote_consumer(TaskKind put) { return role(put).consumer; }

}  // namespace hpmoe::taskflow
