#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank; MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int n = 1024; float *x = malloc(n*4), *y = malloc(n*4);
  for (int i=0;i<n;i++) x[i]=i;
  for (int r=0;r<2000;r++) MPI_Allreduce(x,y,n,MPI_FLOAT,MPI_SUM,MPI_COMM_WORLD);
  double best=1e9;
  for (int b=0;b<15;b++){ MPI_Barrier(MPI_COMM_WORLD); double t=MPI_Wtime();
    for (int r=0;r<2000;r++) MPI_Allreduce(x,y,n,MPI_FLOAT,MPI_SUM,MPI_COMM_WORLD);
    t=(MPI_Wtime()-t)/2000*1e6; if(t<best)best=t; if(rank==0) printf("%.2f ",t);}
  if(rank==0) printf("\nC MPI_Allreduce 4KiB best %.2f us\n", best);
  MPI_Finalize();
}
