/* Preloaded into the sanitized test runs (scripts/sanitize.sh): dlclose does nothing, so
 * every library a process loads stays mapped until it exits. Open MPI opens its plugins and
 * closes those it does not select during MPI_Init; a leak report names the module of each
 * frame, and a closed plugin's frames would name none that tests/sanitize/lsan.supp could
 * match (Note [Leak check before MPI_Finalize], tests/main.cpp). */
int dlclose(void* handle) {
  (void)handle;
  return 0;
}
