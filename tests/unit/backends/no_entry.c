/* A shared object that is no pvgpu backend: it exports a function, but not
 * pvgpu_backend_entry (test_backend.cpp: the missing-symbol error). */
int pvgpu_test_not_an_entry(void);

int pvgpu_test_not_an_entry(void) { return 0; }
