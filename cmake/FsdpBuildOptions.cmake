# Build-wide options for libfsdp's own targets; included by the root CMakeLists.txt before any
# target is defined. Nothing here reaches consumers of the installed package.
#
#   FSDP_WERROR=ON                      warnings are errors (via fsdp_warnings)
#   FSDP_SANITIZE=address,undefined     or thread: -fsanitize=... for compile and link of every
#                                       target of this project (scripts/sanitize.sh uses it)
#   FSDP_CCACHE=ON (default)            compile through ccache when it is installed
#   FSDP_PCH=ON (default)               precompile LibTorch's and gtest's headers for the tests, and
#                                       <torch/torch.h> once for the examples and benchmarks
#                                       (fsdp_precompile_headers below)
#   FSDP_UNITY_BUILD=ON (default)       compile the library's sources in batches of FSDP_UNITY_BATCH
#                                       (0, the default: one batch)
#                                       (root CMakeLists.txt), the test binary's in batches of
#                                       FSDP_TESTS_UNITY_BATCH (tests/CMakeLists.txt), the example
#                                       trainer's in batches of 6 (examples/gpt/CMakeLists.txt)
#   FSDP_TESTS_O1=ON (default)          compile fsdp_tests' own sources at -O1 in optimized builds
#                                       (tests/CMakeLists.txt): about 0.6 of their -O3 compile time;
#                                       the library, examples and benchmarks keep the build type's -O
#   FSDP_ALL_O1=OFF (default)           every target at -O1 in optimized builds: a build to test, not
#                                       to time (CI's LibTorch 2.6 leg, scripts/test-trixie.sh)

option(FSDP_WERROR "Treat compiler warnings as errors (libfsdp's own targets)" OFF)
set(FSDP_SANITIZE "" CACHE STRING
    "Sanitizers for every target, as for -fsanitize= (address,undefined or thread); empty: none")
option(FSDP_CCACHE "Compile through ccache when it is found" ON)
option(FSDP_PCH "Precompile torch/torch.h once per target instead of parsing it in every source" ON)
option(FSDP_UNITY_BUILD "Compile the library's, the tests' and the example trainer's sources in batches (one translation unit each)" ON)
set(FSDP_UNITY_BATCH 0 CACHE STRING "Library sources per translation unit under FSDP_UNITY_BUILD (0: all in one)")
set(FSDP_TESTS_UNITY_BATCH 16 CACHE STRING "Test sources per translation unit under FSDP_UNITY_BUILD")
option(FSDP_TESTS_O1 "Compile the test binary's own sources at -O1 in optimized builds" ON)
option(FSDP_ALL_O1 "Compile every target of this project at -O1 in optimized builds (for tests, not timing)" OFF)
if(FSDP_ALL_O1 AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  # Directory-wide, after the build type's flags on each command line, so this -O is the one used.
  add_compile_options($<$<NOT:$<CONFIG:Debug>>:-O1>)
endif()

# --- fsdp_warnings: the warning flags of every target in this project -----------------------
# Each target links it PRIVATE. The library takes it through its LINK_LIBRARIES property rather
# than target_link_libraries(): for a static library, a PRIVATE link still lands in the exported
# INTERFACE_LINK_LIBRARIES (as $<LINK_ONLY:...>), and the build-tree export would then need this
# target in the export set. An INTERFACE library with only compile options has nothing to link,
# so the library's own compile is all it has to reach.
add_library(fsdp_warnings INTERFACE)
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  # -Wall -Wextra, minus unused parameters (virtual overrides and hooks keep their full
  # signature); the rest is what the code is already clean for. Not clean, so not here:
  # -Wmissing-declarations (src/runtime's hooks are declared where they are used),
  # -Wlogical-op (errno == EAGAIN || errno == EWOULDBLOCK, equal on Linux), -Wformat=2 (the
  # collectives benchmark's printf wrapper passes its format through).
  target_compile_options(fsdp_warnings INTERFACE
    -Wall -Wextra -Wno-unused-parameter
    -Wnon-virtual-dtor -Woverloaded-virtual -Wvla)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(fsdp_warnings INTERFACE -Wduplicated-cond)
  endif()
  if(FSDP_WERROR)
    target_compile_options(fsdp_warnings INTERFACE -Werror)
  endif()
elseif(MSVC)
  target_compile_options(fsdp_warnings INTERFACE /W4 $<$<BOOL:${FSDP_WERROR}>:/WX>)
endif()

# --- sanitizers ---------------------------------------------------------------------------------
# Directory-wide (this directory and every subdirectory added after it), so that every target,
# including test executables added later, is compiled and linked with the same -fsanitize=.
set(FSDP_SANITIZE_FLAGS "")
if(FSDP_SANITIZE)
  string(REPLACE ";" "," _fsdp_sanitize "${FSDP_SANITIZE}")
  if(_fsdp_sanitize MATCHES "thread" AND _fsdp_sanitize MATCHES "address")
    message(FATAL_ERROR "FSDP_SANITIZE: thread cannot be combined with address")
  endif()
  set(FSDP_SANITIZE_FLAGS -fsanitize=${_fsdp_sanitize} -fno-omit-frame-pointer)
  add_compile_options(${FSDP_SANITIZE_FLAGS})
  add_link_options(-fsanitize=${_fsdp_sanitize})
  message(STATUS "libfsdp: sanitizers ${_fsdp_sanitize}")
endif()

# --- ccache ---------------------------------------------------------------------------------
# base_dir = the source tree, so that clones in other directories (CI's fresh clone, git
# worktrees) share cache entries; hash_dir off for the same reason when -g is on (the working
# directory then appears in the debug information only, not in the code).
if(FSDP_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(FSDP_CCACHE_PROGRAM ccache)
  if(FSDP_CCACHE_PROGRAM)
    set(CMAKE_CXX_COMPILER_LAUNCHER
        ${CMAKE_COMMAND} -E env CCACHE_BASEDIR=${PROJECT_SOURCE_DIR} CCACHE_NOHASHDIR=1
        # Precompiled headers are cacheable only with these (ccache's manual, "Precompiled headers").
        CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
        ${FSDP_CCACHE_PROGRAM})
    message(STATUS "libfsdp: compiling through ${FSDP_CCACHE_PROGRAM}")
  endif()
endif()

# --- precompiled headers ----------------------------------------------------------------------
# fsdp_precompile_headers(<target> <header>...): with FSDP_PCH, <header>s are parsed once for the
# target and included first in each of its sources. Parsing LibTorch's headers is a large share of
# each source's compile time (measured in bench/results/build.md).
function(fsdp_precompile_headers target)
  if(FSDP_PCH)
    target_precompile_headers(${target} PRIVATE ${ARGN})
  endif()
endfunction()

# fsdp_share_torch_pch(<target>...): with FSDP_PCH, the examples and benchmarks share one
# precompiled <torch/torch.h> (target fsdp_apps_pch, made on first use) instead of each parsing it.
# Only for targets compiled with the same options as fsdp_apps_pch (it links fsdp::fsdp and
# fsdp_warnings, whose -Wvla changes a predefined macro); -Winvalid-pch makes a precompiled header
# that the compiler refuses visible.
function(fsdp_share_torch_pch)
  if(NOT FSDP_PCH)
    return()
  endif()
  if(NOT TARGET fsdp_apps_pch)
    file(CONFIGURE OUTPUT ${PROJECT_BINARY_DIR}/fsdp_apps_pch.cpp CONTENT "// anchor for the shared <torch/torch.h> PCH\n")
    add_library(fsdp_apps_pch OBJECT ${PROJECT_BINARY_DIR}/fsdp_apps_pch.cpp)
    target_link_libraries(fsdp_apps_pch PRIVATE fsdp::fsdp fsdp_warnings)
    target_precompile_headers(fsdp_apps_pch PRIVATE <torch/torch.h>)
  endif()
  foreach(target IN LISTS ARGN)
    target_precompile_headers(${target} REUSE_FROM fsdp_apps_pch)
    if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
      target_compile_options(${target} PRIVATE -Winvalid-pch)
    endif()
  endforeach()
endfunction()
