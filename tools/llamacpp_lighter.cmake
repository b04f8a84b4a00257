# Included by tools/build_llamacpp.sh right after each project() call of llama.cpp's build
# (CMAKE_PROJECT_INCLUDE). Compiles the code around the kernels at -O1: llama-server's HTTP/JSON layer, the
# common helpers and the multimodal projector's graph builders spend their time in C++ templates at compile
# time, not at run time, where the work is ggml's kernels (still -O3) and libllama (untouched).
# Measured 2026-11-29 on a 2-core AMD EPYC (Zen 4), `cmake --build -j 2` of the three tools: 306 s -> 252 s
# (mtmd 42.5 -> 31.0 s; server, common, quantize and perplexity 166 -> 125 s), with decode tokens/s of
# bench/bench_gguf.py --quick within its run-to-run spread (docs/benchmarks.md).
if(PROJECT_NAME STREQUAL "llama.cpp")
  function(_ernie_studio_lighter)
    foreach(target llama-common llama-common-base mtmd server-context llama-server-impl)
      if(TARGET ${target})
        # after CMAKE_CXX_FLAGS_RELEASE's -O3 on the command line, so this one counts
        target_compile_options(${target} PRIVATE -O1)
      endif()
    endforeach()
  endfunction()
  cmake_language(DEFER CALL _ernie_studio_lighter)
endif()
