/* shm_direct.h — collectives that reach the peers' buffers themselves (mapped shared tensors, or
 * process_vm_readv) instead of passing the data through the segment's slots. */
#ifndef FSC_SHM_DIRECT_H
#define FSC_SHM_DIRECT_H

#include "comm/shm_internal.h"

/* 1 when op `a` runs direct on this group: the group agreed on direct reads at join and the op's
 * sizes fall in the window (shm_direct.c). Depends only on the group and the op's header, so
 * every rank of the op decides alike. */
int fsc_shm_direct_fits(const fsc_shm_group_t *g, const fsc_shm_args_t *a);

/* Rank 0, after an op that fsc_shm_direct_run left a timing for (g->choice_pending): record how
 * long it took, `secs`, for the way it went. */
void fsc_shm_direct_timed(fsc_shm_group_t *g, double secs);

/* Run collective `a` direct to completion on the calling thread when it can (*ran = 1): when it
 * fits (above), or when it is large enough to ask and every rank's buffers lie in one shared tensor
 * allocation. With *ran = 0 the caller runs it on the slots; every rank decides alike. */
fsc_status_t fsc_shm_direct_run(fsc_shm_group_t *g, const fsc_shm_args_t *a, int *ran);

#endif /* FSC_SHM_DIRECT_H */
