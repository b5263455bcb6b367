# paratrain_add_mpi_test(<name> <ranks> <command...>): a ctest test <name>.np<ranks>
# that runs <command> under mpirun with <ranks> processes.
#
# Open MPI refuses to run as root, or with more ranks than cores, unless told. These
# tests are ours to launch, so we tell it here instead of asking the user, and keep
# one intra-op thread per rank so that ranks do not fight over the cores.
set(PARATRAIN_MPIRUN_ENV
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
  OMP_NUM_THREADS=1)

function(paratrain_add_mpi_test name ranks)
  add_test(NAME ${name}.np${ranks}
    COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${MPIEXEC_PREFLAGS} ${ARGN} ${MPIEXEC_POSTFLAGS})
  set_tests_properties(${name}.np${ranks} PROPERTIES
    ENVIRONMENT "${PARATRAIN_MPIRUN_ENV}" TIMEOUT 600 PROCESSORS ${ranks} LABELS mpi)
endfunction()
