# A stand-in for the paratrain-config.cmake that Conan's CMakeDeps generates from
# conanfile.py's package_info (Conan cannot be installed here): the same targets, made
# the same way, in the same order, so that the build module the recipe ships,
# cmake/paratrainConanSystemDeps.cmake, can be tested without Conan.
#   - range-v3 is found first (CMakeDeps calls find_dependency for each requirement);
#   - every component is an INTERFACE IMPORTED target carrying its cpp_info: include
#     dirs, defines, system_libs, and the components it requires;
#   - the package's target (cmake_target_name, paratrain::all) links every component;
#   - then the build modules are included.
include(CMakeFindDependencyMacro)
find_dependency(range-v3)

get_filename_component(_paratrain_package "${CMAKE_CURRENT_LIST_DIR}/../../../.." ABSOLUTE)
foreach(_target IN ITEMS paratrain::paratrain paratrain::mpi paratrain::nccl paratrain::gloo paratrain::hdf5
                        paratrain::all)
  if(NOT TARGET ${_target})
    add_library(${_target} INTERFACE IMPORTED)
  endif()
endforeach()
set_property(TARGET paratrain::paratrain APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${_paratrain_package}/include")
set_property(TARGET paratrain::paratrain APPEND PROPERTY INTERFACE_LINK_LIBRARIES range-v3::range-v3 pthread)
set_property(TARGET paratrain::mpi APPEND PROPERTY INTERFACE_LINK_LIBRARIES paratrain::paratrain)
set_property(TARGET paratrain::mpi APPEND PROPERTY INTERFACE_COMPILE_DEFINITIONS PARATRAIN_HAS_MPI=1)
set_property(TARGET paratrain::nccl APPEND PROPERTY INTERFACE_LINK_LIBRARIES paratrain::paratrain)
set_property(TARGET paratrain::nccl APPEND PROPERTY INTERFACE_COMPILE_DEFINITIONS PARATRAIN_HAS_NCCL=1)
set_property(TARGET paratrain::gloo APPEND PROPERTY INTERFACE_LINK_LIBRARIES paratrain::paratrain)
set_property(TARGET paratrain::gloo APPEND PROPERTY INTERFACE_COMPILE_DEFINITIONS PARATRAIN_HAS_GLOO=1)
set_property(TARGET paratrain::hdf5 APPEND PROPERTY INTERFACE_LINK_LIBRARIES paratrain::paratrain)
set_property(TARGET paratrain::hdf5 APPEND PROPERTY INTERFACE_COMPILE_DEFINITIONS PARATRAIN_HAS_HDF5=1)
set_property(TARGET paratrain::all APPEND PROPERTY INTERFACE_LINK_LIBRARIES
             paratrain::hdf5 paratrain::gloo paratrain::nccl paratrain::mpi paratrain::paratrain)

include("${_paratrain_package}/cmake/paratrainConanSystemDeps.cmake")
unset(_paratrain_package)
unset(_target)
