#pragma once
// The interleaved schedule's orders: how each worker's queue of tiles is
// ordered (hpmoe run --policy). Every order runs the same verified program
// and gives bit-identical results; they differ only in time.
#include <string>

namespace hpmoe::taskflow {

enum class Policy { fill, rank_rotated, critical_path, interleave_wgrad, ratr };
Policy parse_policy(const std::string&);  // "critical-path", "fill", ...; Error lists the names
const char* name(Policy);

}  // namespace hpmoe::taskflow
