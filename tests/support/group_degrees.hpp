#pragma once
// The degrees a test of a layer cut over one mesh dimension runs at: the whole world, and 2
// beside it at 4 ranks (two groups of 2, so that a group is not the world).
#include <vector>

namespace paratrain_test {

inline std::vector<int> group_degrees(int world) {
  std::vector<int> degrees{world};
  if (world == 4) degrees.push_back(2);
  return degrees;
}

}  // namespace paratrain_test
