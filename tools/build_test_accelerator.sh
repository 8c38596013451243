#!/usr/bin/env bash
# Builds the test accelerator (tests/support/test_accelerator: the PrivateUse1 backend "sac_accel"
# over host memory) and installs its package, sac_test_accelerator, into the venv, so that any
# script run with that venv can `import sac_test_accelerator`. tools/test.sh does not need this:
# tools/build.sh builds the accelerator with the tests and the tests import it from the build tree
# (SAC_TEST_BUILD_DIR). Uses the build tree tools/build.sh makes (build/torch-<version> unless
# SAC_BUILD_DIR says otherwise), configuring one if there is none.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
require_venv
command -v cmake >/dev/null || fail "cmake is not installed; run bash tools/setup.sh first"
build="${SAC_BUILD_DIR:-$root/build/torch-$torch_version}"
if [ ! -f "$build/CMakeCache.txt" ]; then
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S "$root" -B "$build" "${generator[@]}" -DSAC_PYTHON="$python" -DSAC_BUILD_TESTS=ON >/dev/null
fi
cmake --build "$build" --target sac_test_accelerator
package="$build/test_accelerator/sac_test_accelerator"
[ -f "$package/libsac_test_accelerator.so" ] \
  || fail "$build was configured without the tests (SAC_BUILD_TESTS=OFF), so it has no test accelerator; run bash tools/build.sh"
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/sac_test_accelerator"
cp -r "$package" "$site/sac_test_accelerator"
(cd / && "$python" -c 'import sac_test_accelerator, torch; assert torch.accelerator.current_accelerator().type == "sac_accel"') \
  || fail "installed $site/sac_test_accelerator, but importing it does not register the sac_accel device"
echo "build_test_accelerator: sac_test_accelerator built against torch $torch_version and installed into $site"
