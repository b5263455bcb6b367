# Builds TARGET in BINARY_DIR, expecting the build to fail with EXPECT in its output.
execute_process(
  COMMAND ${CMAKE_COMMAND} --build ${BINARY_DIR} --target ${TARGET}
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(result EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must not:\n${out}")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "${TARGET} failed to compile, but without the expected message\n  ${EXPECT}\n${out}")
endif()
message(STATUS "${TARGET} failed to compile, as expected, with: ${CMAKE_MATCH_0}")
