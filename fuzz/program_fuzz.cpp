// libFuzzer target: program dumps (`hpmoe verify FILE`). Any input is
// either rejected by the loader or the verifier with an hpmoe::Error (or a
// failed report), or verified; the verifier must never crash, read out of
// bounds or throw anything else, whatever the dump claims.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>

#include "hpmoe/error.hpp"
#include "compiler/taskflow.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto j = nlohmann::json::parse(data, data + size, nullptr, false);
  if (j.is_discarded()) return 0;
  try {
    const auto programs = hpmoe::taskflow::programs_from_dump(j, "fuzz");
    (void)hpmoe::taskflow::verify(programs);
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
