#pragma once
// The version of the compiled-program format (the task IR, its JSON dumps).
// It lives with the model because a layer's fingerprint, which every rank of
// a sharded run exchanges, covers it: ranks built with different formats
// refuse to run together.
namespace hpmoe::taskflow {

inline constexpr int kFormatVersion = 2;

}  // namespace hpmoe::taskflow
