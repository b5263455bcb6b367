// Fashion-MNIST with DDP over NCCL: one process per GPU, the model and every batch on it.
// No MPI: ranks meet at MASTER_ADDR:MASTER_PORT (comm::Rendezvous), as torchrun starts them,
// or under srun/mpirun with those two exported (examples/launch/slurm.sbatch).
#include "train.hpp"

using Strategy = paratrain::DataParallel<fashion_mnist::Net, paratrain::comm::Nccl, torch::optim::Adam>;

int main(int argc, char** argv) { return fashion_mnist::run<Strategy>(argc, argv); }
