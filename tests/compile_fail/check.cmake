# Compiles TARGET's one source in BINARY_DIR, expecting the compiler to fail with EXPECT in
# its output; or, given LOG instead of EXPECT, expecting it to fail and writing its output to
# LOG (every case in one TU, ALL_CASES, written anew from the cases in the folder CASES first: tests/compile_fail/
# attribute.py judges each case from LOG).
#
# With Ninja, the compiler is called directly with the command Ninja would run (`ninja -t
# commands`, its last line: the source's own compilation; the precompiled header it reuses
# is built by the test build). No build-tree lock is taken, so these tests run in parallel
# under `ctest -j`. Other generators build the target through CMake, one at a time.
if(DEFINED LOG)
  file(REMOVE ${LOG})  # never judged by the output of an earlier run
endif()
if(DEFINED ALL_CASES)  # the cases as they read now, edits since the configure included
  include(${CMAKE_CURRENT_LIST_DIR}/all_cases.cmake)
  file(GLOB cases ${CASES}/*.cpp)
  paratrain_compile_fail_all_cases(${ALL_CASES} ${cases})
endif()
if(GENERATOR STREQUAL "Ninja")
  execute_process(COMMAND ${NINJA} -C ${BINARY_DIR} -t commands ${TARGET}
                  RESULT_VARIABLE result OUTPUT_VARIABLE commands ERROR_VARIABLE commands)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "ninja -t commands ${TARGET} failed:\n${commands}")
  endif()
  string(STRIP "${commands}" commands)
  string(REGEX REPLACE "^.*\n" "" compile "${commands}")
  execute_process(COMMAND sh -c "${compile}" WORKING_DIRECTORY ${BINARY_DIR}
                  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
else()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${BINARY_DIR} --target ${TARGET}
                  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
endif()
if(result EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must not:\n${out}")
endif()
if(DEFINED LOG)
  file(WRITE ${LOG} "${out}")
  message(STATUS "${TARGET} failed to compile, as it must; its output is in ${LOG}")
  return()
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "${TARGET} failed to compile, but without the expected message\n  ${EXPECT}\n${out}")
endif()
message(STATUS "${TARGET} failed to compile, as expected, with: ${CMAKE_MATCH_0}")
