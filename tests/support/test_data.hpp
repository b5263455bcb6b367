#pragma once
// tests/data, the folder of the tests' recorded files, found from this header's own path
// (absolute: the tests include it through the tests folder, an absolute -I), so no
// definition on the command line stands between the test files and a unity build or the
// precompiled header they share with other targets.
#include <filesystem>

namespace paratrain_test {

inline std::filesystem::path test_data_dir() {
  return std::filesystem::path(__FILE__).parent_path().parent_path() / "data";
}

}  // namespace paratrain_test
