#!/usr/bin/env bash
# bench/gpu/fetch-deps.sh — run HERE (Debian 12), before a GPU check: downloads the
# Debian packages ferry builds and tests against into .gpu-deps/ (ignored by git), for
# the device machine, whose image has CUDA, gcc and meson but maybe not these
# libraries. Name .gpu-deps in the device call's carry list; check.sh unpacks them into
# a private root when the machine lacks them. The C runtime, gcc's libraries, zlib,
# libffi, pcre2 and OpenSSL are left to the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu-deps/' .git/info/exclude 2>/dev/null || echo '/.gpu-deps/' >> .git/info/exclude
mkdir -p .gpu-deps
cd .gpu-deps
apt-get download \
    libopenblas-openmp-dev libopenblas0-openmp libgfortran5 libquadmath0 \
    libcjson-dev libcjson1 libjemalloc-dev libjemalloc2 libnuma-dev libnuma1 \
    libcriterion-dev libcriterion3 libboxfort-dev libgit2-1.5 libnanomsg5 \
    libhttp-parser2.9 libmbedtls14 libmbedx509-1 libmbedcrypto7 libssh2-1 \
    pkgconf pkgconf-bin libpkgconf3
du -sh .
