# Compiles TARGET's one source in BINARY_DIR, expecting the compiler to fail with EXPECT in
# its output.
#
# With Ninja, the compiler is called directly with the command Ninja would run (`ninja -t
# commands`, its last line: the source's own compilation; the precompiled header it reuses
# is built by the test build). No build-tree lock is taken, so these tests run in parallel
# under `ctest -j`. Other generators build the target through CMake, one at a time.
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
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "${TARGET} failed to compile, but without the expected message\n  ${EXPECT}\n${out}")
endif()
message(STATUS "${TARGET} failed to compile, as expected, with: ${CMAKE_MATCH_0}")
