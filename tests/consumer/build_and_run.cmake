# cmake -P driver for the consumer tests (tests/CMakeLists.txt, label `consumer`):
# builds a downstream project the way a user would, with a CMake of its own, and runs
# what it built.
#
#   -DMODE=install  -DBUILD_DIR=<paratrain build tree> -DPREFIX=<empty-or-old prefix>
#       `cmake --install` of that tree into PREFIX, emptied first so that no header
#       removed from the source survives from an earlier run.
#   -DMODE=project  -DSOURCE_DIR=<project> -DBINARY_DIR=<its build tree>
#                   -DGENERATOR=<generator> -DCXX_COMPILER=<compiler>
#                   [-DCONFIGURE_ARGS=a|b|...] [-DRUN=command|arg|...] [-DEXPECT_OUTPUT=<regex>]
#                   [-DFAILING_ARGS=a|b|... -DEXPECT_FAILURE=<regex>]
#       configures and builds SOURCE_DIR (one job: a LibTorch TU takes about 1.3 GB),
#       then runs RUN, which must exit 0 and, with EXPECT_OUTPUT, print a match. With
#       FAILING_ARGS, first checks that configuring with those arguments added fails
#       with a message matching EXPECT_FAILURE.
#   -DMODE=components -DPARATRAIN_SOURCE_DIR=<paratrain> -DSOURCE_DIR=<components project>
#                   -DBINARY_DIR=<scratch> -DGENERATOR=<generator> -DCXX_COMPILER=<compiler>
#       installs a paratrain configured without its components (MPI hidden, as on a machine
#       without it; tests and examples asked for) and checks, by
#       configuring SOURCE_DIR against it, that the core is found, that an optional
#       component reports paratrain_<component>_FOUND FALSE, and that a required one
#       fails with the reason. Configure steps only: nothing is compiled.
#   Lists are given with | between items: a ; would be split by add_test.
cmake_minimum_required(VERSION 3.25)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " command)
    message(FATAL_ERROR "consumer: ${what} failed (exit ${rc}): ${command}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE "${PREFIX}")
  run_step("installing ${BUILD_DIR}" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}")
  if(NOT EXISTS "${PREFIX}/share/licenses/paratrain/LICENSE")
    message(FATAL_ERROR "consumer: the install has no share/licenses/paratrain/LICENSE")
  endif()

elseif(MODE STREQUAL "project")
  string(REPLACE "|" ";" configure_args "${CONFIGURE_ARGS}")
  string(REPLACE "|" ";" run "${RUN}")
  if(DEFINED FAILING_ARGS)
    string(REPLACE "|" ";" failing_args "${FAILING_ARGS}")
    file(REMOVE_RECURSE "${BINARY_DIR}-failing")
    execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BINARY_DIR}-failing" -G "${GENERATOR}"
                            "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" ${configure_args} ${failing_args}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    message("${out}")
    if(rc EQUAL 0)
      message(FATAL_ERROR "consumer: configuring with ${FAILING_ARGS} succeeded; it must fail")
    elseif(NOT out MATCHES "${EXPECT_FAILURE}")
      message(FATAL_ERROR "consumer: configuring with ${FAILING_ARGS} failed without saying '${EXPECT_FAILURE}'")
    endif()
  endif()
  run_step("configuring ${SOURCE_DIR}"
    "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BINARY_DIR}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" ${configure_args})
  run_step("building ${SOURCE_DIR}" "${CMAKE_COMMAND}" --build "${BINARY_DIR}" --parallel 1)
  if(run)
    run_step("running ${SOURCE_DIR}'s program" ${run})
    if(DEFINED EXPECT_OUTPUT AND NOT step_output MATCHES "${EXPECT_OUTPUT}")
      message(FATAL_ERROR "consumer: the program's output does not match '${EXPECT_OUTPUT}'")
    endif()
  endif()

elseif(MODE STREQUAL "components")
  set(prefix "${BINARY_DIR}/prefix")
  # As on a machine without MPI: MPI hidden from find_package, PARATRAIN_WITH_MPI left at its
  # default (AUTO), the tests and examples asked for as a top-level build asks: the configure
  # must succeed, saying in one line what it left out.
  file(REMOVE_RECURSE "${BINARY_DIR}/paratrain")
  run_step("configuring paratrain without MPI and without components"
    "${CMAKE_COMMAND}" -S "${PARATRAIN_SOURCE_DIR}" -B "${BINARY_DIR}/paratrain" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DPARATRAIN_INSTALL=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON
    -DPARATRAIN_WITH_NCCL=OFF -DPARATRAIN_WITH_GLOO=OFF -DPARATRAIN_WITH_HDF5=OFF)
  foreach(said IN ITEMS "paratrain::mpi is not built: MPI was not found"
                        "without paratrain::mpi, only the tests, examples and benchmarks that start without MPI are configured")
    if(NOT step_output MATCHES "${said}")
      message(FATAL_ERROR "consumer: configuring without MPI did not say '${said}'")
    endif()
  endforeach()
  file(REMOVE_RECURSE "${prefix}")
  run_step("installing it" "${CMAKE_COMMAND}" --install "${BINARY_DIR}/paratrain" --prefix "${prefix}")

  file(REMOVE_RECURSE "${BINARY_DIR}/optional" "${BINARY_DIR}/required")
  run_step("finding paratrain with OPTIONAL_COMPONENTS mpi"
    "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BINARY_DIR}/optional" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_PREFIX_PATH=${prefix}" -DREQUIRE_MPI=OFF)

  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BINARY_DIR}/required" -G "${GENERATOR}"
                          "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_PREFIX_PATH=${prefix}" -DREQUIRE_MPI=ON
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  set(reason "installed without paratrain::mpi: its build had PARATRAIN_WITH_MPI=OFF")
  if(rc EQUAL 0)
    message(FATAL_ERROR "consumer: find_package(paratrain REQUIRED COMPONENTS mpi) succeeded without paratrain::mpi")
  elseif(NOT out MATCHES "${reason}")
    message(FATAL_ERROR "consumer: find_package(paratrain REQUIRED COMPONENTS mpi) failed without saying '${reason}'")
  endif()

else()
  message(FATAL_ERROR "consumer: MODE must be install, project or components, not '${MODE}'")
endif()
