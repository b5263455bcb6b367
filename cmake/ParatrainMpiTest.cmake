# paratrain_add_mpi_test(<name> <ranks> <command...>): a ctest test <name>.np<ranks>
# that runs <command> under mpirun with <ranks> processes.
#
# Open MPI refuses to run as root, or with more ranks than cores, unless told. These
# tests are ours to launch, so we tell it here instead of asking the user, and keep
# one intra-op thread per rank so that ranks do not fight over the cores.
# Open MPI 5 (Debian 13, scripts/compat.sh) launches through PRRTE, whose parameters for
# the same two settings have other names; each version ignores the other's.
set(PARATRAIN_MPIRUN_ENV
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
  PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe PRTE_MCA_hwloc_default_binding_policy=none
  OMP_NUM_THREADS=1)

function(paratrain_add_mpi_test name ranks)
  add_test(NAME ${name}.np${ranks}
    COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${MPIEXEC_PREFLAGS} ${ARGN} ${MPIEXEC_POSTFLAGS})
  # The watchdog's limit (PARATRAIN_TIMEOUT, 10 min by default) well below ctest's: a
  # collective that hangs is named by the watchdog, not killed silently by ctest.
  set_tests_properties(${name}.np${ranks} PROPERTIES
    ENVIRONMENT "${PARATRAIN_MPIRUN_ENV};PARATRAIN_TIMEOUT=120" TIMEOUT 600 PROCESSORS ${ranks} LABELS mpi)
endfunction()

# paratrain_default_timeouts(): every test of this directory that sets no TIMEOUT gets
# PARATRAIN_DEFAULT_TEST_TIMEOUT (ctest's own default is 10^7 s: a test that hangs would hang
# CI). tests/ and examples/ defer a call to it to the end of their directory, after every
# add_test (and after an early return()).
set(PARATRAIN_DEFAULT_TEST_TIMEOUT 300 CACHE STRING "TIMEOUT, in seconds, of the tests that set none")
function(paratrain_default_timeouts)
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(t IN LISTS tests)
    get_test_property(${t} TIMEOUT timeout)
    if(NOT timeout)
      set_tests_properties(${t} PROPERTIES TIMEOUT ${PARATRAIN_DEFAULT_TEST_TIMEOUT})
    endif()
  endforeach()
endfunction()
