#include "source_dir.hpp"

namespace hpmoe::test_support {
const char* source_dir() { return HPMOE_SOURCE_DIR_PATH; }
}  // namespace hpmoe::test_support
