#!/usr/bin/env bash
# Run test files under AddressSanitizer: every extension the run compiles (the CPU build of
# kernels/, by the builder fix uses) is instrumented, and the ASan runtime is preloaded into
# every process (pytest, its workers, the forked `qwen-kvprep` children, the compilers are
# spared), so a heap misuse anywhere (free() of a bad pointer, a double free) and an
# out-of-bounds access in our instrumented code are reported. torch itself is not
# instrumented.
#
#   bench/asan_run.sh [PYTEST ARGS...]
#
# PYTHON     the interpreter whose environment runs pytest (default: .venv/bin/python)
# ASAN_OUT   where the reports go (default: a new folder under TMPDIR; kept)
# Without arguments: the test files that run our native code inside the pytest worker, in
# the full suite's order, in one worker (-n 1). Extra environment (OMP_NUM_THREADS,
# PYTHONMALLOC=malloc, ...) passes through.
#
# How: torch.utils.cpp_extension compiles with $CXX (the setting users have too), so CXX
# names a wrapper that adds -fsanitize=address; the builder's flags, and so what users get,
# are unchanged. A canary (an instrumented overflow loaded into this Python) proves the set-up
# reports before the tests run. Exit status: pytest's, or 3 when ASan reported anything, or 4
# when no extension was compiled or one is not instrumented.
set -euo pipefail

# All in one function: bash reads a script as it runs, and this one runs for many minutes.
main() {
  cd "$(dirname "$0")/.."
  python=${PYTHON:-.venv/bin/python}
  libasan=$(gcc -print-file-name=libasan.so)
  [ -e "$libasan" ] || { echo "no libasan.so for gcc (apt-get install libasan8)"; exit 2; }
  out=${ASAN_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvprep-asan.XXXXXX")}
  mkdir -p "$out/bin" "$out/reports"
  rm -f "$out/reports/"*

  real_cxx=$(command -v "${CXX:-c++}")
  # the compiler itself runs without the preloaded runtime
  printf '#!/bin/sh\nunset LD_PRELOAD\nexec "%s" -fsanitize=address -fno-omit-frame-pointer "$@"\n' \
    "$real_cxx" > "$out/bin/c++"
  chmod +x "$out/bin/c++"

  export CXX="$out/bin/c++"
  export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$out/reports/asan"
  # libstdc++ too: Python does not link it, and ASan's interceptor of __cxa_throw (every C++
  # exception, e.g. a TORCH_CHECK failing) must find the real one at start-up, or it aborts
  # with "CHECK failed: ... real___cxa_throw"
  export LD_PRELOAD="$libasan $(gcc -print-file-name=libstdc++.so)"

  # canary: a one-byte heap overflow in an instrumented library called from this Python
  printf '#include <stdlib.h>\nextern "C" int canary(int i) { char *p = (char *)malloc(8); p[i] = 1; int r = p[0]; free(p); return r; }\n' \
    > "$out/canary.cpp"
  "$CXX" -shared -fPIC -o "$out/canary.so" "$out/canary.cpp"
  if ASAN_OPTIONS="$ASAN_OPTIONS:abort_on_error=0" "$python" -c \
      "import ctypes, sys; ctypes.CDLL(sys.argv[1]).canary(8)" "$out/canary.so" 2>/dev/null \
      || ! grep -qs "heap-buffer-overflow" "$out/reports/"asan.*; then
    echo "the canary overflow was not reported: this set-up would miss errors"; exit 2
  fi
  rm -f "$out/reports/"*

  "$python" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__)"
  echo "reports: $out/reports; OMP_NUM_THREADS=${OMP_NUM_THREADS-unset} (tests/conftest.py sets 1"\
    "on torch >= 2.1 where unset); PYTHONMALLOC=${PYTHONMALLOC-unset}"
  if [ "$#" -eq 0 ]; then
    # test_crash_keeps_the_last_phase_and_output's child kills itself with SIGSEGV on purpose:
    # ASan's handler reports that and ends it with SIGABRT instead, which the test cannot accept
    set -- -n 1 tests/test_fastkv_model.py tests/test_kernels.py \
      tests/test_smoke.py tests/test_sources.py \
      --deselect tests/test_smoke.py::test_crash_keeps_the_last_phase_and_output
  fi
  status=0
  "$python" -m pytest --basetemp="$out/pytest" -q "$@" || status=$?

  # every extension the run compiled must be instrumented, or "clean" means nothing
  built=0
  while IFS= read -r so; do
    built=$((built + 1))
    if ! nm -D "$so" | grep -q __asan_report; then
      echo "not instrumented: $so"; status=4
    fi
  done < <(find "$out/pytest" -path '*/builds/*' -name '*.so' 2>/dev/null)
  echo "extensions compiled with ASan in this run: $built"
  if [ "$built" -eq 0 ]; then
    echo "no extension was compiled: none of our native code ran instrumented"; status=4
  fi
  if compgen -G "$out/reports/asan.*" > /dev/null; then
    echo "AddressSanitizer reports:"
    for report in "$out/reports/"asan.*; do echo "--- $report"; cat "$report"; done
    exit 3
  fi
  echo "AddressSanitizer: no report"
  exit "$status"
}

main "$@"
