# paratrain_pch: the one precompiled <torch/torch.h> that the tests, examples and
# benchmarks reuse.
#
# Note [One precompiled header]
# torch/torch.h costs ~20 s per translation unit; precompiled, loading it costs ~5 s. The
# tests, examples and benchmarks share one precompiled header (about 600 MB), made by this
# target alone from an empty source, so that building one example (scripts/demo.sh) or one
# benchmark (scripts/bench.sh) builds the header and that program, not the test suite that
# used to own the header. Every target that reuses it must compile with the same
# definitions: paratrain::mpi's, and no others (GCC refuses a precompiled header made under
# other macros: "not used because `NAME' not defined"), so components with definitions of
# their own (paratrain::hdf5, paratrain::gloo) are linked with $<LINK_ONLY:...> or go
# without it. Never on the INTERFACE library: users choose their own.
file(CONFIGURE OUTPUT ${PROJECT_BINARY_DIR}/paratrain_pch.cpp
     CONTENT "// The translation unit that makes the precompiled header (cmake/ParatrainPch.cmake).\n")
add_library(paratrain_pch OBJECT ${PROJECT_BINARY_DIR}/paratrain_pch.cpp)
target_link_libraries(paratrain_pch PRIVATE paratrain::mpi)
# The tests' warnings: a precompiled header records them, and the tests are its strictest user.
target_compile_options(paratrain_pch PRIVATE -Wall -Wextra -Wno-missing-field-initializers)
target_precompile_headers(paratrain_pch PRIVATE <torch/torch.h>)
