// Fashion-MNIST with DDP: one process per core (or GPU), under mpirun or srun.
#include "train.hpp"

using Strategy = paratrain::DataParallel<fashion_mnist::Net, paratrain::comm::Mpi, torch::optim::Adam>;

int main(int argc, char** argv) { return fashion_mnist::run<Strategy>(argc, argv); }
