"""Conan 2 recipe for paratrain, a header-only library.

    conan create . -s compiler.cppstd=20      # builds and runs test_package/

What comes from Conan and what from the system
----------------------------------------------
Conan provides paratrain's headers and range-v3 (ConanCenter's range-v3/0.12.0).
LibTorch, MPI with Boost.MPI, CUDA with NCCL, Gloo's headers and HDF5 come from the
system: ConanCenter's libtorch is built without distributed support (no c10d), and
there is no NCCL recipe; HDF5 is found by CMake's FindHDF5 like the rest, so that
paratrain::hdf5 uses the HDF5 the system's other libraries use. The package therefore carries a CMake build module,
paratrainConanSystemDeps.cmake, that the config CMakeDeps generates includes: it finds
LibTorch always, and a component's system dependencies when find_package asks for that
component, exactly as the `cmake --install` package does (docs/packaging.md):

    find_package(paratrain CONFIG REQUIRED COMPONENTS mpi)
    target_link_libraries(app PRIVATE paratrain::mpi)

Components and targets
----------------------
paratrain (paratrain::paratrain, the core), mpi (paratrain::mpi), nccl (paratrain::nccl;
with mpi too for comm/nccl/bootstrap_over_mpi.hpp), gloo (paratrain::gloo), hdf5 (paratrain::hdf5). CMakeDeps makes the package's own target link every
component, so that target is paratrain::all rather than paratrain::paratrain, which
must stay the core alone.

The package holds every component's headers whatever the machine has: with
auto_header_only the package id keeps no settings or options, so nothing may change
which files are packaged. There are no options for that reason; the components are
chosen by find_package(... COMPONENTS ...), where the consumer's machine is known.

License: BSD-3-Clause (LICENSE at the root, packaged in licenses/), as PyTorch and LibTorch.
"""

import os
import re

from conan import ConanFile
from conan.tools.build import check_min_cppstd
from conan.tools.files import copy, load
from conan.tools.layout import basic_layout

required_conan_version = ">=2.0.8"  # implements = ["auto_header_only"]


class ParatrainConan(ConanFile):
    name = "paratrain"
    license = "BSD-3-Clause"
    description = "Header-only C++20 data, sharded and pipeline parallel training for LibTorch"
    topics = ("deep-learning", "libtorch", "distributed-training", "mpi", "nccl", "hdf5", "header-only")
    package_type = "header-library"
    implements = ["auto_header_only"]
    settings = "os", "arch", "compiler", "build_type"
    exports_sources = "include/*", "cmake/*", "CMakeLists.txt", "LICENSE"
    no_copy_source = True

    # Where the CMake helpers go in the package (not a find_package location: CMakeDeps
    # writes paratrain's config, which includes the build module from here).
    _cmake_dir = os.path.join("share", "paratrain", "cmake")

    def set_version(self):
        # The one version number lives in CMakeLists.txt's project().
        cmakelists = load(self, os.path.join(self.recipe_folder, "CMakeLists.txt"))
        self.version = re.search(r"project\(\s*paratrain\s+VERSION\s+([0-9.]+)", cmakelists).group(1)

    def layout(self):
        basic_layout(self)

    def requirements(self):
        # paratrain's public headers include range-v3's.
        self.requires("range-v3/0.12.0", transitive_headers=True)

    def validate(self):
        check_min_cppstd(self, 20)

    def build(self):
        pass  # header-only: nothing to build

    def package(self):
        copy(self, "LICENSE", src=self.source_folder, dst=os.path.join(self.package_folder, "licenses"))
        copy(self, "*.hpp",
             src=os.path.join(self.source_folder, "include"),
             dst=os.path.join(self.package_folder, "include"))
        for helper in ("paratrainDependencies.cmake", "paratrainConanSystemDeps.cmake"):
            copy(self, helper,
                 src=os.path.join(self.source_folder, "cmake"),
                 dst=os.path.join(self.package_folder, self._cmake_dir))

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "paratrain")
        self.cpp_info.set_property("cmake_target_name", "paratrain::all")
        self.cpp_info.set_property("cmake_build_modules",
                                   [os.path.join(self._cmake_dir, "paratrainConanSystemDeps.cmake")])

        core = self.cpp_info.components["paratrain"]
        core.set_property("cmake_target_name", "paratrain::paratrain")
        core.requires = ["range-v3::range-v3"]
        core.bindirs = []
        core.libdirs = []
        if self.settings.os in ("Linux", "FreeBSD"):
            # LocalDataParallel and data::Loader run threads; data::read_idx reads gzip (zlib1g-dev).
            core.system_libs = ["pthread", "z"]

        # The components' libraries (libmpi, libboost_mpi, libcudart, libnccl, libhdf5) are linked
        # by the build module through the targets their own CMake packages define, with
        # full paths: a bare `-lnccl` or `-lmpi` here would fail wherever they are not
        # on the linker's default path (/usr/local/cuda/lib, /opt/openmpi/lib, ...).
        for component, requires, define in (("mpi", ["paratrain"], "PARATRAIN_HAS_MPI=1"),
                                             ("nccl", ["paratrain"], "PARATRAIN_HAS_NCCL=1"),
                                             ("gloo", ["paratrain"], "PARATRAIN_HAS_GLOO=1"),
                                             ("hdf5", ["paratrain"], "PARATRAIN_HAS_HDF5=1")):
            info = self.cpp_info.components[component]
            info.set_property("cmake_target_name", f"paratrain::{component}")
            info.requires = requires
            info.defines = [define]
            info.includedirs = []
            info.bindirs = []
            info.libdirs = []
