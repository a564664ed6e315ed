#pragma once
// The repository's root, for the tests' data files (routing traces, machine
// models, configs). It is compiled into one object (source_dir.cpp) rather
// than defined on every test's command line, so that the test sources do
// not depend on where the clone lives and ccache serves them across clones.
namespace hpmoe::test_support {
const char* source_dir();
}
#define HPMOE_SOURCE_DIR (::hpmoe::test_support::source_dir())
