// Fashion-MNIST with DP: one process, one replica per core (or per GPU).
#include "train.hpp"

using Strategy = paratrain::LocalDataParallel<fashion_mnist::Net, torch::optim::Adam>;

int main(int argc, char** argv) { return fashion_mnist::run<Strategy>(argc, argv); }
