# Install rules: each component's headers and a relocatable CMake package, so that a
# downstream project can `find_package(paratrain CONFIG [COMPONENTS mpi nccl gloo hdf5])` against
# `cmake --install`'s prefix. docs/packaging.md.
#
# Note [One export set per component]
# paratrain::paratrain and each component (paratrain::mpi, paratrain::nccl,
# paratrain::gloo, paratrain::hdf5) are exported in sets of their own:
# paratrainTargets.cmake, paratrainMpiTargets.cmake, ... paratrainConfig.cmake includes a
# component's file only when that component is asked for, after finding that component's
# dependencies. One set would name Boost::mpi, MPI::MPI_CXX, CUDA::cudart and HDF5's
# targets in every find_package(paratrain), so a machine without CUDA could not use even
# the core. A
# component that was not built has no file, and find_package reports
# paratrain_<component>_FOUND FALSE with the reason.
#
# Nothing in the exported files is an absolute path of the build machine: dependencies
# are named by their imported targets (torch, range-v3::range-v3, Boost::mpi,
# MPI::MPI_CXX, CUDA::cudart, and FindHDF5's hdf5::hdf5_cpp and HDF5::HDF5), found again
# by the config on the consumer's machine, and
# NCCL and Gloo, which have no CMake package of their own, by paratrain::libnccl and
# paratrain::libgloo, which the config makes from its own find_library/find_path
# (cmake/paratrainDependencies.cmake).

include(CMakePackageConfigHelpers)

# Header-only, so the package is the same for every architecture: it goes in share/.
set(PARATRAIN_INSTALL_CMAKEDIR ${CMAKE_INSTALL_DATADIR}/cmake/paratrain CACHE STRING
    "Where paratrain's CMake package is installed, relative to the prefix")

install(TARGETS paratrain EXPORT paratrainTargets FILE_SET HEADERS)
install(EXPORT paratrainTargets NAMESPACE paratrain:: DESTINATION ${PARATRAIN_INSTALL_CMAKEDIR})
# The components this build made; paratrainConfig.cmake.in names the same files.
foreach(paratrain_pair IN ITEMS mpi:paratrainMpiTargets nccl:paratrainNcclTargets gloo:paratrainGlooTargets
                               hdf5:paratrainHdf5Targets)
  string(REPLACE ":" ";" paratrain_pair ${paratrain_pair})
  list(GET paratrain_pair 0 paratrain_component)
  list(GET paratrain_pair 1 paratrain_export_set)
  if(TARGET paratrain_${paratrain_component})
    install(TARGETS paratrain_${paratrain_component} EXPORT ${paratrain_export_set} FILE_SET HEADERS)
    install(EXPORT ${paratrain_export_set} NAMESPACE paratrain:: DESTINATION ${PARATRAIN_INSTALL_CMAKEDIR})
  endif()
endforeach()

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/paratrainConfig.cmake.in
  ${PROJECT_BINARY_DIR}/paratrainConfig.cmake
  INSTALL_DESTINATION ${PARATRAIN_INSTALL_CMAKEDIR}
  NO_SET_AND_CHECK_MACRO)
# 0.x: a minor version may break the API, so only the same minor version matches.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/paratrainConfigVersion.cmake
  COMPATIBILITY SameMinorVersion
  ARCH_INDEPENDENT)
# The license travels with the headers, where Debian and Conan put a package's licenses.
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/licenses/paratrain)
install(FILES
  ${PROJECT_BINARY_DIR}/paratrainConfig.cmake
  ${PROJECT_BINARY_DIR}/paratrainConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/paratrainDependencies.cmake
  DESTINATION ${PARATRAIN_INSTALL_CMAKEDIR})
