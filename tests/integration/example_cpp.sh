#!/usr/bin/env bash
# examples/cpp built as a user builds it: against hpmoe installed into a
# prefix (libhpmoe.so, include/hpmoe, the CMake package), then run.
set -euo pipefail
: "${BUILD_DIR:?}" "${HPMOE_SOURCE_DIR:?}"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cmake --install "$BUILD_DIR" --prefix "$tmp/prefix" --component dev > /dev/null
# Only public headers are installed: nothing of src/ may be reachable.
if grep -rhoE '#include "[a-z]+/' "$tmp/prefix/include" | grep -v '"hpmoe/' ; then
  echo "an installed header includes a header that is not installed"; exit 1
fi
cmake -S "$HPMOE_SOURCE_DIR/examples/cpp" -B "$tmp/build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_CXX_FLAGS="${EXAMPLE_FLAGS:-}" -DCMAKE_EXE_LINKER_FLAGS="${EXAMPLE_FLAGS:-}" > /dev/null
cmake --build "$tmp/build" > /dev/null
out=$("$tmp/build/layer_step")
echo "$out"
[ "$(grep -c "tokens: out" <<< "$out")" = 2 ] || { echo "the example did not run both steps"; exit 1; }
# Placement planning is in the installed library, its machine models found beside it (share/hpmoe/machines).
grep -q "^placement: [0-9]* online revisions" <<< "$out" || { echo "the example's online placement did not run"; exit 1; }
test -f "$tmp/prefix/share/hpmoe/machines/cpu-local.json"

