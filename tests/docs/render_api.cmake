# Renders the API reference with DOXYGEN into OUTPUT_DIR and checks that the public
# classes have pages.
file(READ ${SOURCE_DIR}/docs/Doxyfile config)
string(APPEND config "\nOUTPUT_DIRECTORY = ${OUTPUT_DIR}\n")
file(WRITE ${OUTPUT_DIR}/Doxyfile "${config}")
execute_process(COMMAND ${DOXYGEN} ${OUTPUT_DIR}/Doxyfile WORKING_DIRECTORY ${SOURCE_DIR}
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "doxygen failed:\n${out}")
endif()
foreach(page index.html classparatrain_1_1DataParallel.html classparatrain_1_1comm_1_1Mpi.html
             classparatrain_1_1LocalDataParallel.html)
  if(NOT EXISTS ${OUTPUT_DIR}/html/${page})
    message(FATAL_ERROR "the API reference has no ${page}")
  endif()
endforeach()
message(STATUS "API reference: ${OUTPUT_DIR}/html/index.html")
