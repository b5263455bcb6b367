// Fashion-MNIST on one device.
#include "train.hpp"

using Strategy = paratrain::DataParallel<fashion_mnist::Net, paratrain::comm::SingleDevice, torch::optim::Adam>;

int main(int argc, char** argv) { return fashion_mnist::run<Strategy>(argc, argv); }
