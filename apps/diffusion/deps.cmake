# Third-party dependencies of flame_diffusion, all from Debian packages installed by
# scripts/setup_deps.sh: libpng (PNG writing), zlib (gunzip of the IDX files; libpng needs it too)
# and CLI11 (header-only, the CLI). The GPU machine has no apt: scripts/prepare_carry.sh copies
# headers and static libraries into .deps/, searched after the system paths (PATHS, not HINTS), as
# the top-level CMakeLists does for nlohmann-json.
set(FD_DEPS_DIR ${PROJECT_SOURCE_DIR}/.deps)

find_path(FD_PNG_INCLUDE_DIR png.h PATHS ${FD_DEPS_DIR}/png/include)
find_library(FD_PNG_LIBRARY NAMES png16 png PATHS ${FD_DEPS_DIR}/png/lib)
if(NOT FD_PNG_INCLUDE_DIR OR NOT FD_PNG_LIBRARY)
  message(FATAL_ERROR "flame-diffusion: libpng not found (png.h: ${FD_PNG_INCLUDE_DIR}, library: "
                      "${FD_PNG_LIBRARY}): install the Debian package libpng-dev (scripts/setup_deps.sh), "
                      "or fill .deps/png with scripts/prepare_carry.sh")
endif()
find_path(FD_ZLIB_INCLUDE_DIR zlib.h PATHS ${FD_DEPS_DIR}/png/include)
find_library(FD_ZLIB_LIBRARY NAMES z PATHS ${FD_DEPS_DIR}/png/lib)
if(NOT FD_ZLIB_INCLUDE_DIR OR NOT FD_ZLIB_LIBRARY)
  message(FATAL_ERROR "flame-diffusion: zlib not found (zlib.h: ${FD_ZLIB_INCLUDE_DIR}, library: "
                      "${FD_ZLIB_LIBRARY}): install the Debian package zlib1g-dev (scripts/setup_deps.sh), "
                      "or fill .deps/png with scripts/prepare_carry.sh")
endif()
find_path(FD_CLI11_INCLUDE_DIR CLI/CLI.hpp PATHS ${FD_DEPS_DIR}/cli11/include)
if(NOT FD_CLI11_INCLUDE_DIR)
  message(FATAL_ERROR "flame-diffusion: CLI11 (CLI/CLI.hpp) not found: install the Debian package "
                      "libcli11-dev (scripts/setup_deps.sh), or fill .deps/cli11 with scripts/prepare_carry.sh")
endif()
message(STATUS "flame-diffusion: libpng ${FD_PNG_LIBRARY}, zlib ${FD_ZLIB_LIBRARY}, CLI11 ${FD_CLI11_INCLUDE_DIR}")

# PUBLIC: the tests read PNGs back with libpng, and main.cpp uses CLI11.
target_include_directories(flame_diffusion PUBLIC ${FD_PNG_INCLUDE_DIR} ${FD_ZLIB_INCLUDE_DIR} ${FD_CLI11_INCLUDE_DIR})
target_link_libraries(flame_diffusion PUBLIC ${FD_PNG_LIBRARY} ${FD_ZLIB_LIBRARY} m)
# The data-set lookup's last resort (.deps/fashion_mnist of this checkout, filled by prepare_carry.sh),
# so that a binary run from any directory on the GPU machine finds the files.
target_compile_definitions(flame_diffusion PRIVATE FLAME_DIFFUSION_DEPS_DIR="${FD_DEPS_DIR}")

# ---- text tokenizers of flame_models (models/tokenizer_*.cpp) ----
# utf8proc (NFC, categories, case) and RE2 (CLIP's pre-tokenisation regex), static libraries of the
# Debian packages libutf8proc-dev and libre2-dev; SentencePiece (T5's spiece.model) from
# libsentencepiece-dev, which ships no static library: .deps/sentencepiece holds the shared one
# (it bundles protobuf-lite, so nothing else is needed), found at run time through the build-tree
# RPATH CMake records.
find_path(FD_UTF8PROC_INCLUDE_DIR utf8proc.h PATHS ${FD_DEPS_DIR}/text/include)
find_library(FD_UTF8PROC_LIBRARY NAMES libutf8proc.a utf8proc PATHS ${FD_DEPS_DIR}/text/lib)
find_path(FD_RE2_INCLUDE_DIR re2/re2.h PATHS ${FD_DEPS_DIR}/text/include)
find_library(FD_RE2_LIBRARY NAMES libre2.a re2 PATHS ${FD_DEPS_DIR}/text/lib)
find_path(FD_SPM_INCLUDE_DIR sentencepiece_processor.h PATHS ${FD_DEPS_DIR}/sentencepiece/include)
find_library(FD_SPM_LIBRARY NAMES sentencepiece PATHS ${FD_DEPS_DIR}/sentencepiece/lib)
foreach(dep UTF8PROC_INCLUDE_DIR UTF8PROC_LIBRARY RE2_INCLUDE_DIR RE2_LIBRARY SPM_INCLUDE_DIR SPM_LIBRARY)
  if(NOT FD_${dep})
    message(FATAL_ERROR "flame-diffusion: ${dep} not found for the text tokenizers: install the Debian packages "
                        "libutf8proc-dev libre2-dev libsentencepiece-dev (scripts/setup_deps.sh), or fill "
                        ".deps/text and .deps/sentencepiece with scripts/prepare_carry.sh")
  endif()
endforeach()
message(STATUS "flame-diffusion: utf8proc ${FD_UTF8PROC_LIBRARY}, RE2 ${FD_RE2_LIBRARY}, SentencePiece ${FD_SPM_LIBRARY}")
find_package(Threads REQUIRED)
target_include_directories(flame_models PRIVATE ${FD_UTF8PROC_INCLUDE_DIR} ${FD_RE2_INCLUDE_DIR} ${FD_SPM_INCLUDE_DIR}
                                                ${FD_ZLIB_INCLUDE_DIR})
target_link_libraries(flame_models PRIVATE ${FD_SPM_LIBRARY} ${FD_RE2_LIBRARY} ${FD_UTF8PROC_LIBRARY}
                                           ${FD_ZLIB_LIBRARY} Threads::Threads)

# ---- IDX parser fuzzer (Note [IDX fuzz contract] in tests/fuzz/fuzz_idx.cpp) ----
# Built from the library's src/data/idx.cpp alone (FLAME's headers, no FLAME library), so the
# sanitizers see every read. A short seeded run is a ctest test; the long libFuzzer run is
# tests/fuzz/run_libfuzzer_idx.sh.
if(FLAME_TESTS)
  set(FD_FUZZ_SOURCES ${CMAKE_CURRENT_LIST_DIR}/tests/fuzz/fuzz_idx.cpp ${PROJECT_SOURCE_DIR}/src/data/idx.cpp)
  add_executable(flame_fuzz_idx ${FD_FUZZ_SOURCES})
  target_include_directories(flame_fuzz_idx PRIVATE ${PROJECT_SOURCE_DIR}/include ${FD_ZLIB_INCLUDE_DIR})
  target_link_libraries(flame_fuzz_idx PRIVATE ${FD_ZLIB_LIBRARY})
  add_test(NAME diffusion.fuzz_idx_short COMMAND flame_fuzz_idx --seed 1 --seconds 10)
  set_tests_properties(diffusion.fuzz_idx_short PROPERTIES TIMEOUT 120)
  if(FLAME_LIBFUZZER)
    add_executable(flame_libfuzzer_idx ${FD_FUZZ_SOURCES})
    target_include_directories(flame_libfuzzer_idx PRIVATE ${PROJECT_SOURCE_DIR}/include ${FD_ZLIB_INCLUDE_DIR})
    target_link_libraries(flame_libfuzzer_idx PRIVATE ${FD_ZLIB_LIBRARY})
    target_compile_definitions(flame_libfuzzer_idx PRIVATE FLAME_LIBFUZZER=1)
    target_compile_options(flame_libfuzzer_idx PRIVATE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all)
    target_link_options(flame_libfuzzer_idx PRIVATE -fsanitize=fuzzer,address,undefined)
  endif()
endif()

# GoogleTest for diffusion_tests: tests/CMakeLists.txt's find_package(GTest CONFIG) makes imported
# targets visible in tests/ only; find it again here (the source-tree fallback's aliases are global).
if(FLAME_TESTS AND NOT TARGET GTest::gtest)
  find_package(GTest CONFIG QUIET)
  if(NOT TARGET GTest::gtest)
    message(FATAL_ERROR "flame-diffusion: GoogleTest not found: install libgtest-dev (scripts/setup_deps.sh)")
  endif()
endif()

# ---- image data sets and the fine-tuning configuration (src/image_dataset.cpp, src/train_config.cpp) ----
# libwebp (Debian libwebp-dev) decodes WebP training images; optional like libjpeg: a build without
# it reports .webp files as unsupported and skips them. toml++ (libtomlplusplus-dev, used
# header-only) reads the configuration; nlohmann-json (the framework's) reads JSONL manifests.
find_path(FD_WEBP_INCLUDE_DIR webp/decode.h PATHS ${FD_DEPS_DIR}/webp/include)
find_library(FD_WEBP_LIBRARY NAMES libwebp.a webp PATHS ${FD_DEPS_DIR}/webp/lib)
if(FD_WEBP_INCLUDE_DIR AND FD_WEBP_LIBRARY)
  message(STATUS "flame-diffusion: libwebp ${FD_WEBP_LIBRARY}")
  target_include_directories(flame_diffusion PUBLIC ${FD_WEBP_INCLUDE_DIR})
  target_link_libraries(flame_diffusion PUBLIC ${FD_WEBP_LIBRARY})
  target_compile_definitions(flame_diffusion PUBLIC FLAME_DIFFUSION_HAVE_WEBP=1)
else()
  message(WARNING "flame-diffusion: libwebp not found (install libwebp-dev, scripts/setup_deps.sh; "
                  "scripts/prepare_carry.sh fills .deps/webp): WebP training images are skipped in this build")
endif()
find_path(FD_TOMLPP_INCLUDE_DIR toml++/toml.h PATHS ${FD_DEPS_DIR}/tomlplusplus/include)
if(NOT FD_TOMLPP_INCLUDE_DIR)
  message(FATAL_ERROR "flame-diffusion: toml++ (toml++/toml.h) not found: install the Debian package "
                      "libtomlplusplus-dev (scripts/setup_deps.sh), or fill .deps/tomlplusplus with scripts/prepare_carry.sh")
endif()
target_include_directories(flame_diffusion PRIVATE ${FD_TOMLPP_INCLUDE_DIR} ${FLAME_JSON_INCLUDE_DIR})
