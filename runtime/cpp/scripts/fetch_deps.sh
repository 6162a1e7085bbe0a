#!/usr/bin/env bash
# Fetch what libspecrt builds against, into DEPS_DIR (default: runtime/cpp/third_party), without
# touching the machine's own apt configuration or installed packages:
#   include/onnxruntime/*.h   ONNX Runtime C/C++ API headers (Debian 13's libonnxruntime-dev, API 21)
#   include/nlohmann/*.hpp    nlohmann-json (Debian 13's nlohmann-json3-dev), the manifest parser
#   lib/libonnxruntime.so.1   a link to the onnxruntime wheel's bundled library (the default dlopen target)
# Headers come from a private apt state whose only source is the machine's Debian entry with the
# suite set to trixie. Idempotent: what is already there is kept. Usage: fetch_deps.sh [DEPS_DIR] [PYTHON]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
deps="${1:-$here/third_party}"
python="${2:-python3}"
mkdir -p "$deps/include" "$deps/lib"
deps="$(cd "$deps" && pwd)"

if [[ ! -f "$deps/include/onnxruntime/onnxruntime_cxx_api.h" || ! -f "$deps/include/nlohmann/json.hpp" ]]; then
  apt_dir="$deps/apt"
  mkdir -p "$apt_dir/sources.list.d" "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
  src=/etc/apt/sources.list.d/debian.sources
  if [[ -f "$src" ]]; then  # deb822: keep the first stanza (the main archive), suite -> trixie
    awk 'BEGIN{RS=""; ORS="\n\n"} NR==1' "$src" | sed -E 's/^Suites:.*/Suites: trixie/' > "$apt_dir/sources.list.d/trixie.sources"
  else
    echo "Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" > "$apt_dir/sources.list.d/trixie.sources"
  fi
  apt_opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o "Debug::NoLocking=1"
            -o "APT::Sandbox::User=root")
  echo "fetch_deps: apt-get update (private state in $apt_dir)" >&2
  apt-get -q "${apt_opts[@]}" update >/dev/null
  (cd "$apt_dir/debs" && apt-get -q "${apt_opts[@]}" download libonnxruntime-dev nlohmann-json3-dev >/dev/null)
  for deb in "$apt_dir"/debs/*.deb; do dpkg-deb -x "$deb" "$apt_dir/root"; done
  rm -rf "$deps/include/onnxruntime" "$deps/include/nlohmann"
  cp -r "$apt_dir/root/usr/include/onnxruntime" "$deps/include/"
  cp -r "$apt_dir/root/usr/include/nlohmann" "$deps/include/"
  rm -rf "$apt_dir/root" "$apt_dir/lists" "$apt_dir/cache"
fi

if [[ ! -e "$deps/lib/libonnxruntime.so.1" ]]; then
  capi=""
  for py in "$python" "$here/../../.venv/bin/python"; do  # the given python, else the project's venv
    capi="$("$py" -c 'import os, onnxruntime; print(os.path.join(os.path.dirname(onnxruntime.__file__), "capi"))' 2>/dev/null || true)"
    [[ -n "$capi" ]] && break
  done
  lib="$(ls "$capi"/libonnxruntime.so.1.* 2>/dev/null | head -n 1 || true)"
  if [[ -z "$lib" ]]; then
    echo "fetch_deps: no onnxruntime wheel with a bundled libonnxruntime.so.1.* found for $python (pip install 'onnxruntime>=1.22'); set SPECRT_ORT_LIBRARY at run time instead" >&2
  else
    ln -sf "$lib" "$deps/lib/libonnxruntime.so.1"
  fi
fi
echo "$deps"
